"""Parameter pytrees of the Llama-family decoder, with the layers stacked on a leading axis.

Layout (E = hidden, F = intermediate, L = layers, Hq / Hkv = query / KV heads, D = head_dim, V = vocab):

  embed        [V, E]
  layers.attn_norm [L, E]      layers.mlp_norm [L, E]
  layers.wq    [L, E, Hq, D]   layers.bq [L, Hq, D]   (Qwen2; None otherwise)
  layers.wk    [L, E, Hkv, D]  layers.bk [L, Hkv, D]
  layers.wv    [L, E, Hkv, D]  layers.bv [L, Hkv, D]
  layers.wo    [L, Hq, D, E]   layers.bo [L, E]       (Llama/Qwen3 attention_bias; else None)
  layers.q_norm / k_norm [L, D]                        (Qwen3; None otherwise)
  layers.w_gate, w_up [L, E, F]   layers.w_down [L, F, E]   (+ b_gate/b_up [L, F], b_down [L, E] with mlp_bias)
  final_norm   [E]
  lm_head      [E, V]   (None when the embedding is tied)

Fused layout (`fuse_projections`, what `jsparse.load` gives on a GPU without a mesh): q/k/v as one weight and gate/up
as one, so each layer runs one GEMM for each pair instead of three and two (fewer, larger GEMMs read the weights
faster at decode's few rows; eval/results/h100/decode_fixed/):

  layers.wqkv  [L, E, Hq + 2 Hkv, D]  (q heads, then k, then v)   layers.bqkv [L, Hq + 2 Hkv, D]
  layers.w_gate_up [L, E, 2 F]  (gate, then up)                   layers.b_gate_up [L, 2 F]

with wq, wk, wv, w_gate, w_up (and their biases) None. Converters, `expected_shapes`, `param_axes`, sharding and
saved files use the separate layout above; `unfuse_projections` goes back, `projection_views` reads the separate
tensors out of a fused tree without copying them.

`param_axes` gives the same tree with logical axis names (heads, kv_heads, embed, mlp, vocab, layers,
head_dim, norm) so params can be laid on a mesh with `flax.linen.logical_to_mesh_sharding`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from models.config import ModelConfig

Array = jax.Array


@struct.dataclass
class LayerParams:
    attn_norm: Array
    wq: Array
    wk: Array
    wv: Array
    wo: Array
    mlp_norm: Array
    w_gate: Array
    w_up: Array
    w_down: Array
    bq: Optional[Array] = None
    bk: Optional[Array] = None
    bv: Optional[Array] = None
    bo: Optional[Array] = None
    q_norm: Optional[Array] = None
    k_norm: Optional[Array] = None
    b_gate: Optional[Array] = None
    b_up: Optional[Array] = None
    b_down: Optional[Array] = None
    wqkv: Optional[Array] = None
    bqkv: Optional[Array] = None
    w_gate_up: Optional[Array] = None
    b_gate_up: Optional[Array] = None
    # (Hq, Hkv) of a fused wqkv (static: part of the tree's structure); None in the separate layout.
    fused_heads: Optional[tuple] = struct.field(pytree_node=False, default=None)


@struct.dataclass
class Params:
    embed: Array
    layers: LayerParams
    final_norm: Array
    lm_head: Optional[Array] = None


def expected_shapes(cfg: ModelConfig) -> Params:
    """The tree of shapes (tuples) every converter must produce for `cfg`; absent tensors are None."""
    L, E, F = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
    Hq, Hkv, D, V = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size
    opt = lambda cond, shape: shape if cond else None  # noqa: E731
    layers = LayerParams(
        attn_norm=(L, E), wq=(L, E, Hq, D), wk=(L, E, Hkv, D), wv=(L, E, Hkv, D), wo=(L, Hq, D, E),
        mlp_norm=(L, E), w_gate=(L, E, F), w_up=(L, E, F), w_down=(L, F, E),
        bq=opt(cfg.qkv_bias, (L, Hq, D)), bk=opt(cfg.qkv_bias, (L, Hkv, D)), bv=opt(cfg.qkv_bias, (L, Hkv, D)),
        bo=opt(cfg.o_bias, (L, E)), q_norm=opt(cfg.qk_norm, (L, D)), k_norm=opt(cfg.qk_norm, (L, D)),
        b_gate=opt(cfg.mlp_bias, (L, F)), b_up=opt(cfg.mlp_bias, (L, F)), b_down=opt(cfg.mlp_bias, (L, E)),
    )
    return Params(embed=(V, E), layers=layers, final_norm=(E,),
                  lm_head=None if cfg.tie_word_embeddings else (E, V))


def param_axes(cfg: ModelConfig) -> Params:
    """Logical axis names for every parameter (same tree as `Params`)."""
    opt = lambda cond, axes: axes if cond else None  # noqa: E731
    layers = LayerParams(
        attn_norm=("layers", "norm"), mlp_norm=("layers", "norm"),
        wq=("layers", "embed", "heads", "head_dim"), wk=("layers", "embed", "kv_heads", "head_dim"),
        wv=("layers", "embed", "kv_heads", "head_dim"), wo=("layers", "heads", "head_dim", "embed"),
        w_gate=("layers", "embed", "mlp"), w_up=("layers", "embed", "mlp"), w_down=("layers", "mlp", "embed"),
        bq=opt(cfg.qkv_bias, ("layers", "heads", "head_dim")),
        bk=opt(cfg.qkv_bias, ("layers", "kv_heads", "head_dim")),
        bv=opt(cfg.qkv_bias, ("layers", "kv_heads", "head_dim")),
        bo=opt(cfg.o_bias, ("layers", "embed")),
        q_norm=opt(cfg.qk_norm, ("layers", "head_dim")), k_norm=opt(cfg.qk_norm, ("layers", "head_dim")),
        b_gate=opt(cfg.mlp_bias, ("layers", "mlp")), b_up=opt(cfg.mlp_bias, ("layers", "mlp")),
        b_down=opt(cfg.mlp_bias, ("layers", "embed")),
    )
    return Params(embed=("vocab", "embed"), layers=layers, final_norm=("norm",),
                  lm_head=None if cfg.tie_word_embeddings else ("embed", "vocab"))


def _is_shape(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(i, int) for i in x)


def check_shapes(cfg: ModelConfig, params: Params, source: str = "checkpoint") -> None:
    """Raises ValueError naming the first tensor whose shape disagrees with `cfg`."""
    want = jax.tree_util.tree_leaves_with_path(expected_shapes(cfg), is_leaf=_is_shape)
    got = dict(jax.tree_util.tree_leaves_with_path(params))
    for path, shape in want:
        name = jax.tree_util.keystr(path)
        if path not in got:
            raise ValueError(f"{source}: tensor {name} is missing (expected shape {shape})")
        if tuple(got[path].shape) != shape:
            raise ValueError(f"{source}: tensor {name} has shape {tuple(got[path].shape)}, but the config "
                             f"implies {shape}")


def random_params(cfg: ModelConfig, key: Array, dtype=jnp.bfloat16, scale: float = 0.02) -> Params:
    """Random weights of the right shapes (for benchmarks and tests); norms are ones."""
    shapes = expected_shapes(cfg)
    leaves, treedef = jax.tree_util.tree_flatten(shapes, is_leaf=_is_shape)
    keys = jax.random.split(key, len(leaves))
    out = []
    for (path, shape), k in zip(jax.tree_util.tree_leaves_with_path(shapes, is_leaf=_is_shape), keys):
        name = jax.tree_util.keystr(path)
        if "norm" in name:
            out.append(jnp.ones(shape, dtype))
        else:
            out.append((scale * jax.random.normal(k, shape, jnp.float32)).astype(dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


def cast(params: Params, dtype) -> Params:
    """Casts every floating leaf to `dtype`."""
    return jax.tree_util.tree_map(lambda x: jnp.asarray(x, dtype), params)


def to_numpy(params: Params) -> Params:
    return jax.tree_util.tree_map(np.asarray, params)


# ----------------------------------------------------------------------------------------------- fused layout

_FUSED = (("wqkv", ("wq", "wk", "wv"), -2), ("bqkv", ("bq", "bk", "bv"), -2),
          ("w_gate_up", ("w_gate", "w_up"), -1), ("b_gate_up", ("b_gate", "b_up"), -1))


def is_fused(params: Params) -> bool:
    """True when `params` hold the fused q/k/v and gate/up weights (`fuse_projections`)."""
    return params.layers.wqkv is not None


def fuse_by_default(mesh=None) -> bool:
    """Whether `jsparse.load` fuses the projections: on a GPU (where it is measured to save time per decode step)
    and without a mesh (sharding splits the separate weights by heads; a fused q/k/v would cross head groups)."""
    return mesh is None and jax.default_backend() == "gpu"


LAYOUTS = ("default", "fused", "separate")


def with_layout(params: Params, layout: str = "default", mesh=None, donate: bool = False) -> Params:
    """`params` in `layout`: "default" is what `jsparse.load` gives (fused when `fuse_by_default(mesh)`), "fused"
    or "separate" force one. For benchmarks and checks that make their own weights (`random_params`): they time
    what users run unless told otherwise."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: expected one of {LAYOUTS}")
    fuse = fuse_by_default(mesh) if layout == "default" else layout == "fused"
    return fuse_projections(params, donate=donate) if fuse else unfuse_projections(params)


def fuse_projections(params: Params, donate: bool = False) -> Params:
    """`params` in the fused layout (module docstring): wq/wk/wv concatenated on the head axis into wqkv,
    w_gate/w_up on the last axis into w_gate_up (biases likewise). Already fused params come back unchanged.

    donate: delete each separate weight once its fused copy exists, so that loading an 8B model needs about one
      fused pair's worth of extra memory rather than a second copy of all five (only for params nobody else holds).
    """
    lp = params.layers
    if lp.wqkv is not None:
        return params
    updates = {}
    for fused, parts, axis in _FUSED:
        arrays = [getattr(lp, p) for p in parts]
        if arrays[0] is None:
            continue
        updates[fused] = jnp.concatenate(arrays, axis=axis)
        for p, a in zip(parts, arrays):
            updates[p] = None
            if donate and isinstance(a, jax.Array):
                updates[fused].block_until_ready()
                a.delete()
    updates["fused_heads"] = (lp.wq.shape[-2], lp.wk.shape[-2])
    return params.replace(layers=lp.replace(**updates))


@dataclasses.dataclass(frozen=True)
class Slice:
    """A view of `array[..., start:start + size, ...]` on `axis` (a separate weight inside a fused one)."""
    array: Array
    axis: int
    start: int
    size: int

    @property
    def shape(self) -> tuple:
        shape = list(self.array.shape)
        shape[self.axis] = self.size
        return tuple(shape)

    def get(self) -> Array:
        return jax.lax.slice_in_dim(self.array, self.start, self.start + self.size, axis=self.axis) \
            if isinstance(self.array, jax.Array) else np.asarray(self.array)[
                (slice(None),) * (self.axis % self.array.ndim) + (slice(self.start, self.start + self.size),)]


def projection_views(params: Params) -> Params:
    """`params` in the separate layout, without copies: in fused params each separate tensor is a `Slice` of its
    fused one (leaves in the order and with the paths of the separate layout); separate params come back as they
    are."""
    lp = params.layers
    if lp.wqkv is None:
        return params
    hq, hkv = lp.fused_heads
    updates = {name: None for name, _, _ in _FUSED}
    for fused, parts, axis in _FUSED:
        a = getattr(lp, fused)
        if a is None:
            continue
        sizes = (hq, hkv, hkv) if len(parts) == 3 else (a.shape[-1] // 2,) * 2
        start = 0
        for p, size in zip(parts, sizes):
            updates[p] = Slice(a, axis % a.ndim, start, size)
            start += size
    return params.replace(layers=lp.replace(fused_heads=None, **updates))


def unfuse_projections(params: Params) -> Params:
    """The separate layout of fused params (copies of the slices); separate params come back unchanged."""
    return jax.tree_util.tree_map(lambda x: x.get() if isinstance(x, Slice) else x, projection_views(params))
