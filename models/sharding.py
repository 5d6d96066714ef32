"""Tensor- and data-parallel placement on one `jax.sharding.Mesh` with axes `data` (batch) and `model` (heads).

The mesh:

  mesh = make_mesh("data=2,model=4")     # over jax.devices(); the product must equal the device count
  mesh = make_mesh("model=8")            # an axis left out has size 1; one device is a mesh of one

Logical axis names (`models.params.param_axes`, `models.cache.cache_axes`) map to mesh axes through ONE table,
`AXIS_RULES`:

  logical axis   mesh axis   what
  batch          data        rows of tokens, the KV cache, the selection state
  heads          model       query heads of wq / bq / wo (and a state's per-query-head axis)
  kv_heads       model       KV heads of wk / wv / bk / bv, the KV cache, the selection state
  mlp            model       the MLP hidden size F of w_gate / w_up / w_down
  vocab          model       the vocabulary of embed / lm_head (replicated when V % model != 0)
  embed, head_dim, layers, length, norm   -    replicated

A head axis (heads, kv_heads) that does not divide the model axis is an error (`check_heads`): each device must
hold whole KV heads and their whole GQA groups. Contiguous blocks of heads go to each device, so device i holds
KV heads [i*Hkv/m, (i+1)*Hkv/m) and exactly their query heads [i*Hq/m, (i+1)*Hq/m) (GQA group g = h // (Hq/Hkv)).
Any other axis that does not divide its mesh axis (a vocabulary of 49152 on 5 devices) is replicated instead.

How a forward runs sharded (`models.generate.sharded_prefill_step` / `sharded_decode_step` /
`sharded_generate_tokens`): the jitted computation takes params, cache and tokens placed here (`NamedSharding`), and XLA's
SPMD partitioner splits every jnp op by the operands' shardings: q/k/v projections are local per head block,
the output projection `wo` and `w_down` end in a psum over `model` (the only collectives of a dense layer), the
embedding gather and the vocab-sharded logits gather over `model`. Inside the layer the model pins q, k, v and
the cache to their head shardings (`constrain`), so the attention method sees them head-sharded; the attention
kernels (Pallas calls, which XLA cannot partition) run per shard under `jax.shard_map`
(`pallas_kernels.sharding.per_shard`): each device attends over its own batch rows and KV heads.

Kernels per shard (`pallas_kernels.sharding.per_shard`, active whenever a mesh of more than one device is set):
dense prefill/decode (`pallas_kernels.dense`, `dense_decode`), gathered sparse decode and tile-gathered prefill
(`sparse_attention`), Kascade's anchor layers (`anchor_attention`), EvoSparse's block ops (`block_scores`: retrieval
block max, block selection, gathered decode with mass / heat), TSA's scoring and local fill (`tsa_scoring`,
`local_attention`), STS's exact top-k (`topk_select`, on GPU and TPU); and, in plain jnp but per shard because
XLA would otherwise gather every head's rows, TSA's compression gathers (`jsparse.compression`) and the oracle's
and H2O's top-k (`selection.topk_indices(per_shard=True)`), EvoSparse's heat candidates
(`block_scores.heat_candidates`: XLA all-gathered the whole heat f32[L, B, Hkv, nb] for their top-k, 67 MB per
decode step at 128K, batch 8, Llama-3.1-8B). The rest of the glue (index arithmetic, the heat update, other
top-ks) is partitioned by XLA. tests/sharding_check.py counts every method's collectives in the compiled HLO (the README lists them).

Cross-head steps of the methods, and the collective each needs (the results equal the one-device ones, which
tests/sharding_check.py checks on 2x4 and 1x8 meshes for every method, tests/sts_sharding_check.py for STS):

  GQA pooling (Kascade, oracle, quest, h2o, EvoSparse heat, TSA "kv_head")  none: a KV head's query group lives
      on the device that holds the KV head (contiguous head blocks, above).
  Kascade head map (reuse layer head h reads the anchor's row of head head_map[l, h], any KV head)   an
      all-gather over `model` of the anchor's indices i32[B, Hkv, T, K] (the `jnp.take` over the head axis that
      `sparse_decode` applies outside its per-shard kernel; K indices per head, not keys). TSA+Kascade's
      translated anchor maps likewise.
  TSA's shared count per row (every head of a row keeps the same number of tokens, from the scores summed over
      heads)   an all-reduce (sum) over `model` of f32[B, T] per sparse layer (XLA's, from the head-axis sum).
  EvoSparse retrieval set (one per row, from the retrieval heads' block max, handed to every head)   a `pmax`
      over `model` of f32[B, T, nb] inside `block_scores.block_max_scores` (each device maxes over the retrieval
      heads it holds); the set itself is then replicated over `model`.
  TokenButler predictor (layer-0 hidden states -> every layer's and head's logits)   none for its input (the
      hidden state is replicated over `model`); its params (~1% of the model) are replicated, and each device
      selects from its own heads' predicted logits (`butler.head_mask`, `group_indices`: top-k and mask per shard).
  STS (draft attention -> target heads through a head map: target head h of layer l reads the record of draft
      (layer, head) = head_map[l, h], held by any device)   per target layer, the rows its heads read,
      i32 / f32[Hq_t, B, R, W] (R = 1 in decode, a row per query tile in prefill; W the recorded width), gathered
      across `model` by XLA (a masked local gather + an all-reduce over `model`), never the whole record. The
      draft and the target run on the same mesh (`models.speculative.sharded_speculative_generate`; the draft's
      heads must divide the model axis too); the draft's own attention and record stay per head.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from models.cache import KVCache, cache_axes
from models.config import ModelConfig
from models.params import Params, expected_shapes, is_fused, param_axes
from pallas_kernels.sharding import active_mesh  # the kernels' own test (set mesh, > 1 device, not manual)

Array = jax.Array

MESH_AXES = ("data", "model")

# Logical axis name -> mesh axis name (None: replicated). The one table of the sharding layout.
AXIS_RULES: Mapping[str, str | None] = {
    "batch": "data",
    "heads": "model",
    "kv_heads": "model",
    "mlp": "model",
    "vocab": "model",
    "embed": None,
    "head_dim": None,
    "layers": None,
    "length": None,
    "norm": None,
}

# Logical axes that must divide their mesh axis (an error otherwise); the others are replicated when they do not.
STRICT_AXES = ("batch", "heads", "kv_heads")


class ShardingError(ValueError):
    """A mesh spec, or a shape that does not fit the mesh."""


def parse_mesh(spec: str) -> dict[str, int]:
    """"data=2,model=4" -> {"data": 2, "model": 4} (an axis left out has size 1).

    Raises:
      ShardingError: an unknown axis name, a repeated one, or a size that is not a positive integer written in
        ASCII digits.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ShardingError(f"mesh spec {spec!r}: expected 'data=D,model=M' (axes {MESH_AXES})")
    sizes = {name: 1 for name in MESH_AXES}
    seen = set()
    for part in spec.split(","):
        name, sep, value = part.strip().partition("=")
        name = name.strip()
        if not sep or name not in MESH_AXES:
            raise ShardingError(f"mesh spec {spec!r}: {part.strip()!r} is not AXIS=SIZE with AXIS one of {MESH_AXES}")
        if name in seen:
            raise ShardingError(f"mesh spec {spec!r}: axis {name!r} given twice")
        seen.add(name)
        value_text = value.strip()
        size = int(value_text) if value_text.isascii() and value_text.isdigit() else 0
        if size < 1:
            raise ShardingError(f"mesh spec {spec!r}: {name}={value.strip()!r}, expected a positive integer")
        sizes[name] = size
    return sizes


def make_mesh(spec: str | Mapping[str, int] | None = None, devices=None) -> Mesh:
    """A `Mesh` with axes ("data", "model") over `devices` (default `jax.devices()`).

    spec: "data=2,model=4", a dict {"data": 2, "model": 4}, or None (one device: a mesh of one, `model=1`
    over the first device).

    Raises:
      ShardingError: a bad spec, or data * model differs from the number of devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ShardingError("make_mesh: devices is empty: expected at least one device")
    if spec is None:
        sizes, devices = {"data": 1, "model": 1}, devices[:1]
    elif isinstance(spec, str):
        sizes = parse_mesh(spec)
    else:
        sizes = parse_mesh(",".join(f"{k}={v}" for k, v in dict(spec).items()))
    n = sizes["data"] * sizes["model"]
    if n != len(devices):
        raise ShardingError(f"mesh data={sizes['data']} x model={sizes['model']} = {n} devices, but "
                            f"{len(devices)} are available ({devices[0].platform}): expected the product to equal "
                            "the device count")
    grid = np.asarray(devices, dtype=object).reshape(sizes["data"], sizes["model"])
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto, AxisType.Auto))


def mesh_size(mesh, axis: str) -> int:
    """Size of `axis` in a Mesh or AbstractMesh (1 when the mesh lacks it)."""
    return dict(mesh.shape).get(axis, 1)


def check_heads(cfg: ModelConfig, mesh) -> None:
    """Raises ShardingError when the query or KV head count does not divide the model axis."""
    m = mesh_size(mesh, "model")
    for name, count in (("num_heads (Hq)", cfg.num_heads), ("num_kv_heads (Hkv)", cfg.num_kv_heads)):
        if count % m:
            # Sizes that split the heads and fit this mesh's devices (data * model = the device count).
            n = int(np.prod([s for _, s in dict(mesh.shape).items()]))
            ok = [d for d in range(1, cfg.num_kv_heads + 1)
                  if cfg.num_kv_heads % d == 0 and cfg.num_heads % d == 0 and n % d == 0]
            raise ShardingError(f"{name}={count} is not divisible by the mesh's model axis of {m}: each device must "
                                f"hold whole heads; use model in {ok} (with data = {n} / model)")


def check_batch(batch: int, mesh) -> None:
    """Raises ShardingError when `batch` rows do not divide the data axis."""
    d = mesh_size(mesh, "data")
    if batch % d:
        raise ShardingError(f"batch of {batch} rows is not divisible by the mesh's data axis of {d}: pad the batch "
                            f"to a multiple of {d} or use a smaller data axis")


def logical_spec(axes, shape=None, mesh=None) -> P:
    """The PartitionSpec of a tensor with logical `axes` (a tuple of names, one per dim) by `AXIS_RULES`.

    With `shape` and `mesh`: a non-strict axis whose size does not divide its mesh axis is replicated; a strict
    one (batch, heads, kv_heads) raises ShardingError naming the tensor dim.
    """
    out = []
    for i, name in enumerate(axes):
        if name is None:
            out.append(None)
            continue
        if name not in AXIS_RULES:
            raise ShardingError(f"logical axis {name!r}: expected one of {sorted(AXIS_RULES)}")
        mesh_axis = AXIS_RULES[name]
        if mesh_axis is not None and shape is not None and mesh is not None:
            size = mesh_size(mesh, mesh_axis)
            if shape[i] % size:
                if name in STRICT_AXES:
                    raise ShardingError(f"axis {name!r} of size {shape[i]} (shape {tuple(shape)}) is not divisible "
                                        f"by the mesh's {mesh_axis} axis of {size}")
                mesh_axis = None
            elif size == 1:
                mesh_axis = None
        out.append(mesh_axis)
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def _is_axes(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(a, str) or a is None for a in x)


def _is_shape(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(i, int) for i in x)


def tree_shardings(tree, axes_tree, mesh: Mesh):
    """NamedShardings for every array (or shape tuple) of `tree` from the same-structured tree of logical axes."""
    axes_leaves = jax.tree_util.tree_leaves(axes_tree, is_leaf=_is_axes)
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=_is_shape)
    if len(axes_leaves) != len(leaves):
        raise ShardingError(f"{len(leaves)} arrays but {len(axes_leaves)} axis annotations: trees differ")
    out = [NamedSharding(mesh, logical_spec(ax, getattr(x, "shape", x), mesh)) for x, ax in zip(leaves, axes_leaves)]
    return jax.tree_util.tree_unflatten(treedef, out)


def check_unfused(params: Params) -> None:
    """Params on a mesh must be in the separate q/k/v and gate/up layout (ShardingError naming the fix)."""
    if is_fused(params):
        raise ShardingError("params in the fused q/k/v and gate/up layout cannot be placed on a mesh (a fused q/k/v "
                            "would be split across head groups): expected the separate layout, "
                            "models.params.unfuse_projections(params) (jsparse.on_mesh does this)")


def param_shardings(cfg: ModelConfig, mesh: Mesh, params: Params | None = None) -> Params:
    """NamedSharding per parameter (q/k/v/o by heads, MLP by hidden, vocab by model, norms replicated), for
    `params` or, when None, for the shapes `cfg` implies."""
    check_heads(cfg, mesh)
    if params is not None:
        check_unfused(params)
    return tree_shardings(expected_shapes(cfg) if params is None else params, param_axes(cfg), mesh)


def shard_params(cfg: ModelConfig, params: Params, mesh: Mesh) -> Params:
    """Places params on the mesh. Host (numpy) leaves are copied shard by shard: each device receives only its
    slice, and no device holds a full copy of a sharded tensor."""
    return jax.device_put(params, param_shardings(cfg, mesh, params))


def placer(cfg: ModelConfig, mesh: Mesh):
    """`place(name, host_array) -> jax.Array` for the checkpoint loaders: "embed", "layers.wq", ... (the names of
    `models.convert.params_to_numpy`) placed by `param_shardings` with `jax.make_array_from_callback`: each device
    receives its slice of the host array only (no device holds a full copy of a sharded tensor), and on several
    hosts (`jax.distributed.initialize`) each process fills only the devices it owns."""
    check_heads(cfg, mesh)
    named = {".".join(str(getattr(k, "name", k)) for k in path): sh
             for path, sh in jax.tree_util.tree_leaves_with_path(param_shardings(cfg, mesh))}

    def place(name: str, array) -> Array:
        if name not in named:
            raise ShardingError(f"no sharding for tensor {name!r}: expected one of {sorted(named)}")
        array = np.asarray(array)
        return jax.make_array_from_callback(array.shape, named[name], lambda index: array[index])
    return place


def cache_shardings(cache: KVCache, mesh: Mesh) -> KVCache:
    """k, v [L, B, Hkv, N, D]: batch over data, KV heads over model; lengths [B] over data."""
    return tree_shardings(cache, cache_axes(), mesh)


def shard_cache(cache: KVCache, mesh: Mesh) -> KVCache:
    return jax.device_put(cache, cache_shardings(cache, mesh))


def cache_sharding_for(cfg: ModelConfig, batch: int, capacity: int, mesh: Mesh) -> KVCache:
    """The cache's NamedShardings without building it."""
    shape = (cfg.num_layers, batch, cfg.num_kv_heads, capacity, cfg.head_dim)
    return tree_shardings(KVCache(k=shape, v=shape, lengths=(batch,)), cache_axes(), mesh)


def state_axes(shape, cfg: ModelConfig, batch: int) -> tuple:
    """Logical axes of one selection-state array, from its shape: the batch axis (dim 0, or dim 1 behind a
    leading per-layer axis) -> batch, and the dim after it when it counts KV or query heads -> kv_heads / heads;
    anything else replicated. When the layer count equals the batch, a leading axis of that size is taken for the
    layers if the dims after it read as [B, heads, ...]. Every method's state is laid out so (heat [L, B, Hkv, nb],
    Kascade's indices [B, Hkv, T, K], H2O's scores [L, B, Hkv, N], TSA's kept [L, B], ...): the state shards with
    its cache."""
    shape = tuple(shape)
    axes = [None] * len(shape)
    heads = (cfg.num_kv_heads, cfg.num_heads)
    if len(shape) >= 2 and shape[1] == batch and (shape[0] != batch or (
            shape[0] == cfg.num_layers and (len(shape) < 3 or shape[2] in heads or shape[1] not in heads))):
        b = 1  # behind a leading per-layer axis (also when L == B: [L, B, Hkv, ...] rather than [B, Hkv, ...])
    elif len(shape) >= 1 and shape[0] == batch:
        b = 0
    else:
        return tuple(axes)
    axes[b] = "batch"
    if len(shape) > b + 1:
        if shape[b + 1] == cfg.num_kv_heads:
            axes[b + 1] = "kv_heads"
        elif shape[b + 1] == cfg.num_heads:
            axes[b + 1] = "heads"
    return tuple(axes)


def state_shardings(state: Any, cfg: ModelConfig, batch: int, mesh: Mesh):
    """NamedSharding per selection-state array (`state_axes`); None for a state of no arrays."""
    def one(x):
        axes = state_axes(x.shape, cfg, batch)
        spec = [AXIS_RULES[a] if a is not None else None for a in axes]
        for i, a in enumerate(axes):  # batch must divide data (checked with the cache); a head axis may not
            if spec[i] is not None and x.shape[i] % mesh_size(mesh, spec[i]):
                spec[i] = None
        return NamedSharding(mesh, P(*spec))
    return jax.tree_util.tree_map(one, state)


def shard_state(state: Any, cfg: ModelConfig, batch: int, mesh: Mesh):
    return jax.device_put(state, state_shardings(state, cfg, batch, mesh))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh, ndim: int = 1) -> NamedSharding:
    """Rows over data, the rest replicated (tokens i32[B, T], lengths i32[B], logits f32[B, ..., V])."""
    return NamedSharding(mesh, P("data", *([None] * (ndim - 1))) if mesh_size(mesh, "data") > 1 else P())


def shard_batch(x, mesh: Mesh):
    x = np.asarray(x) if not isinstance(x, jax.Array) else x
    check_batch(x.shape[0], mesh)
    return jax.device_put(x, batch_sharding(mesh, x.ndim))


# ----------------------------------------------------------------------------------------------- inside a trace


def constrain(x, axes):
    """`with_sharding_constraint(x, spec of logical axes)` under an active mesh; x unchanged otherwise.

    x: an array (axes: a tuple of names) or a pytree with a same-structured tree of axes."""
    mesh = active_mesh()
    if mesh is None:
        return x
    def one(a, ax):
        # Lenient: an axis that does not divide its mesh axis (a batch of 1 on data=2) stays unsplit here; the
        # placement functions are where a misfit raises.
        spec = [AXIS_RULES.get(n) if n is not None else None for n in ax]
        spec = [m if m is not None and a.shape[i] % mesh_size(mesh, m) == 0 else None for i, m in enumerate(spec)]
        return jax.lax.with_sharding_constraint(a, P(*spec))
    if _is_axes(axes):
        return one(x, axes)
    leaves = jax.tree_util.tree_leaves(axes, is_leaf=_is_axes)
    xs, treedef = jax.tree_util.tree_flatten(x)
    return jax.tree_util.tree_unflatten(treedef, [one(a, ax) for a, ax in zip(xs, leaves)])


def use_mesh(mesh: Mesh | None):
    """Context manager setting `mesh` as the ambient mesh (`jax.set_mesh`); a no-op context for None."""
    import contextlib
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)
