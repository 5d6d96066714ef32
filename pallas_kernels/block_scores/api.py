"""Dispatch of the block_scores ops: implementation=None picks "pallas_gpu" on a GPU when the kernel takes the
arguments, else "xla"; "reference" is the plain-jnp specification. Naming one explicitly never falls back."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.block_scores import reference, xla
from pallas_kernels.layers import check_layer
from pallas_kernels.sharding import MODEL, active_mesh, dims, per_shard
from pallas_kernels.sparse_attention.stacked import check_stacked_args, select_layer

Array = jax.Array

IMPLEMENTATIONS = ("pallas_gpu", "xla", "reference")


def supported(implementation: str, q: Array, *, block_size: int) -> bool:
    """Whether `implementation` can run the ops on queries like q."""
    if implementation == "pallas_gpu":
        from pallas_kernels.block_scores import gpu
        return gpu.unsupported_reason(q.dtype, q.shape[-1], block_size) is None
    return implementation in IMPLEMENTATIONS


def _pick(implementation: str | None, q: Array, block_size: int) -> str:
    if implementation is None:
        if jax.default_backend() == "gpu" and supported("pallas_gpu", q, block_size=block_size):
            return "pallas_gpu"
        return "xla"
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}: expected one of {IMPLEMENTATIONS} or None")
    return implementation


def block_max_scores(q: Array, k_all: Array, layer: Array, kv_heads: Array, head_mask: Array, positions: Array,
                     lo: Array, hi: Array, *, block_size: int, scale: float | None = None,
                     implementation: str | None = None) -> Array:
    """Retrieval block max, f32[B, T, N // block_size] (semantics: `reference.block_max_scores_reference`).

    Under a mesh (`pallas_kernels.sharding`): per shard, each device takes the max over the retrieval heads it
    holds (the others masked out), then a `pmax` over `model` of the f32[B, T, nb] result (the cross-head step:
    the retrieval set is one per row, shared by every head)."""
    if active_mesh() is not None:
        check_layer(layer, k_all.shape[0])  # a known layer is checked here: the shards see it traced

        def local(q, k_all, layer, kv_heads, head_mask, positions, lo, hi):
            if MODEL not in jax.sharding.get_abstract_mesh().manual_axes:  # run whole (`per_shard`'s fallback)
                return block_max_scores(q, k_all, layer, kv_heads, head_mask, positions, lo, hi,
                                        block_size=block_size, scale=scale, implementation=implementation)
            h = k_all.shape[2]  # local KV heads; this device holds heads [i * h, (i + 1) * h)
            mine = kv_heads.astype(jax.numpy.int32) - jax.lax.axis_index(MODEL) * h
            held = (mine >= 0) & (mine < h)
            out = block_max_scores(q, k_all, layer, jax.numpy.clip(mine, 0, h - 1), head_mask & held[:, None],
                                   positions, lo, hi, block_size=block_size, scale=scale,
                                   implementation=implementation)
            return jax.lax.pmax(out, MODEL)
        rows = dims(2, 0)
        return per_shard(local, [q, k_all, layer, kv_heads, head_mask, positions, lo, hi],
                         [dims(4, 0, 2), dims(5, 1, 2), (), (None,), (None, None), rows, rows, rows], dims(3, 0))
    impl = _pick(implementation, q, block_size)
    args = (q, k_all, layer, kv_heads, head_mask, positions, lo, hi)
    if impl == "pallas_gpu":
        from pallas_kernels.block_scores import gpu
        return gpu.block_max_scores_gpu(*args, block_size=block_size, scale=scale)
    if impl == "reference":
        return reference.block_max_scores_reference(*args, block_size=block_size, scale=scale)
    return xla.block_max_scores_xla(*args, block_size=block_size, scale=scale)


def _row_dims(indices: Array):
    """The mesh dims of index rows: one layer's [B, Hkv, T, K], or every layer's [L, B, Hkv, T, K]."""
    return dims(5, 1, 2) if indices.ndim == 5 else dims(4, 0, 1)


def _layer_rows(q: Array, k_all: Array, v_all: Array, layer: Array, indices: Array, lengths: Array,
                block_size: int) -> Array:
    """Layer `layer`'s index rows of every layer's [L, B, Hkv, T, K] (checked), or one layer's rows as given: what
    the XLA and reference paths take (the GPU kernels read every layer's rows in place)."""
    if indices.ndim != 5:
        return indices
    check_stacked_args(q, k_all, v_all, layer, indices, lengths, block_size, stacked_indices=True)
    return select_layer(indices, layer)


def sparse_decode_mass(q: Array, k_all: Array, v_all: Array, layer: Array, indices: Array, lengths: Array, *,
                       block_size: int = 1, scale: float | None = None, implementation: str | None = None,
                       config=None):
    """Gathered decode over layer `layer` of a stacked cache and each index entry's softmax mass:
    (out [B, T, Hq, D], mass f32[B, Hkv, T, K]) (semantics: `reference.sparse_decode_mass_reference`).
    indices: the layer's rows int32[B, Hkv, T, K], or every layer's rows [L, B, Hkv, T, K] of which layer
    `layer`'s are used (the GPU kernel reads them in place: no slice of them in XLA).
    config: the Pallas GPU kernel's `sparse_attention.gpu.DecodeConfig` (None: its default). Under a mesh, per
    shard (rows over data, heads over model)."""
    if active_mesh() is not None:
        check_layer(layer, k_all.shape[0])
        kv = dims(5, 1, 2)
        return per_shard(lambda q, k, v, layer, indices, lengths: sparse_decode_mass(
            q, k, v, layer, indices, lengths, block_size=block_size, scale=scale, implementation=implementation,
            config=config), [q, k_all, v_all, layer, indices, lengths],
            [dims(4, 0, 2), kv, kv, (), _row_dims(indices), dims(1, 0)], (dims(4, 0, 2), dims(4, 0, 1)))
    impl = _pick(implementation, q, block_size)
    args = (q, k_all, v_all, layer, indices, lengths)
    if impl == "pallas_gpu":
        from pallas_kernels.block_scores import gpu
        from pallas_kernels.sparse_attention.gpu import DecodeConfig
        return gpu.sparse_decode_mass_gpu(*args, block_size=block_size, scale=scale,
                                          config=DecodeConfig() if config is None else config)
    rows = _layer_rows(q, k_all, v_all, layer, indices, lengths, block_size)
    args = (q, k_all, v_all, layer, rows, lengths)
    if impl == "reference":
        return reference.sparse_decode_mass_reference(*args, block_size=block_size, scale=scale)
    return xla.sparse_decode_mass_xla(*args, block_size=block_size, scale=scale)


def sparse_decode_heat(q: Array, k_all: Array, v_all: Array, layer: Array, indices: Array, lengths: Array,
                       heat: Array, heat_layer: Array | None = None, *, block_size: int = 1,
                       scale: float | None = None, implementation: str | None = None, config=None,
                       tickets: Array | None = None, rows_out: int | None = None):
    """One decode token's gathered decode over layer `layer` of a stacked cache, with each index entry's softmax
    mass added into the stacked heat's row `heat_layer` (None: `layer`): (out [B, 1, Hq, D], heat f32[Lh, B,
    Hkv, nb]) (semantics: `reference.sparse_decode_heat_reference`; on the GPU the heat is updated in place).
    indices: the layer's rows int32[B, Hkv, 1, K], or every layer's rows [L, B, Hkv, 1, K] of which layer
    `layer`'s are used (the GPU kernels read them in place: no slice of them in XLA). The valid entries of each
    index row must be unique and ascending (then -1), as `select_blocks` writes them.
    config: the Pallas GPU kernel's `sparse_attention.gpu.DecodeConfig` (None: its default). Under a mesh, per
    shard (rows over data, heads over model; the heat [Lh, B, Hkv, nb] with them).
    tickets: i32[B, Hkv, 1] zeros, or None: with them the Pallas GPU kernel finishes in the decode's own launch (the
    last program of each row merges it: `gpu.sparse_decode_heat_gpu`) and the result is (out, heat, tickets), the
    tickets zeros again (returned as given by the other implementations and under a mesh); rows_out (with
    tickets, on that kernel only): the output as [1, rows_out, Hq, D] (`models.attention.LayerContext.rows_out`)."""
    if tickets is not None and (active_mesh() is not None or _pick(implementation, q, block_size) != "pallas_gpu"):
        return sparse_decode_heat(q, k_all, v_all, layer, indices, lengths, heat, heat_layer, block_size=block_size,
                                  scale=scale, implementation=implementation, config=config) + (tickets,)
    if active_mesh() is not None:
        check_layer(layer, k_all.shape[0])
        check_layer(layer if heat_layer is None else heat_layer, heat.shape[0])
        kv = dims(5, 1, 2)
        extra = [] if heat_layer is None else [heat_layer]

        def local(q, k, v, layer, indices, lengths, heat, *rest):
            return sparse_decode_heat(q, k, v, layer, indices, lengths, heat, rest[0] if rest else None,
                                      block_size=block_size, scale=scale, implementation=implementation,
                                      config=config)
        return per_shard(local, [q, k_all, v_all, layer, indices, lengths, heat] + extra,
                         [dims(4, 0, 2), kv, kv, (), _row_dims(indices), dims(1, 0), dims(4, 1, 2)]
                         + [()] * len(extra),
                         (dims(4, 0, 2), dims(4, 1, 2)))
    impl = _pick(implementation, q, block_size)
    args = (q, k_all, v_all, layer, indices, lengths, heat, heat_layer)
    if impl == "pallas_gpu":
        from pallas_kernels.block_scores import gpu
        from pallas_kernels.sparse_attention.gpu import DecodeConfig
        return gpu.sparse_decode_heat_gpu(*args, block_size=block_size, scale=scale, tickets=tickets,
                                          rows_out=None if tickets is None else rows_out,
                                          config=DecodeConfig() if config is None else config)
    reference.check_heat_args(q, indices, heat, k_all, block_size)
    rows = _layer_rows(q, k_all, v_all, layer, indices, lengths, block_size)
    args = (q, k_all, v_all, layer, rows, lengths, heat, heat_layer)
    if impl == "reference":
        return reference.sparse_decode_heat_reference(*args, block_size=block_size, scale=scale)
    return xla.sparse_decode_heat_xla(*args, block_size=block_size, scale=scale)


def pending_available(head_dim: int) -> bool:
    """Whether `sparse_decode_pending` / `add_pending_mass` run here: on a GPU whose Triton kernels take this head_dim
    (blocks of one token; they take every float dtype a model runs in), outside a mesh. They have no other
    implementation: a caller that gets False runs `sparse_decode_heat` per layer instead (the same result)."""
    if jax.default_backend() != "gpu" or active_mesh() is not None:
        return False
    from pallas_kernels.block_scores import gpu
    return gpu.unsupported_reason(jnp.bfloat16, head_dim, 1) is None


def pending_shapes(q_shape: tuple, K: int, L: int, Hkv: int, *, config=None) -> tuple:
    """The every-layer buffers of `sparse_decode_pending` (`sparse_attention.stacked.partial_shapes` with blocks of
    one token; config None: the kernel's default `DecodeConfig`), for one token's queries of shape q_shape [B, 1,
    Hq, D] over K keys a row of an L-layer cache with Hkv KV heads."""
    from pallas_kernels.sparse_attention.gpu import DecodeConfig
    from pallas_kernels.sparse_attention.stacked import partial_shapes
    return partial_shapes(q_shape, K, L, Hkv, block_size=1, config=DecodeConfig() if config is None else config)


def sparse_decode_pending(q: Array, k_all: Array, v_all: Array, layer: Array, indices: Array, lengths: Array,
                          pending: tuple, tickets: Array, *, config=None, rows_out: int | None = None):
    """`sparse_decode_heat` (blocks of one token, every layer's rows [L, B, Hkv, 1, K]) with the heat update kept
    for `add_pending_mass`: (out, pending, tickets), one launch on the GPU (`gpu.sparse_decode_pending_gpu`; where
    `pending_available` is False there is none)."""
    from pallas_kernels.block_scores import gpu
    from pallas_kernels.sparse_attention.gpu import DecodeConfig
    return gpu.sparse_decode_pending_gpu(q, k_all, v_all, layer, indices, lengths, pending, tickets,
                                         config=DecodeConfig() if config is None else config, rows_out=rows_out)


def add_pending_mass(indices: Array, pending: tuple, heat: Array, *, group: int, first: int = 0) -> Array:
    """The heat f32[L, B, Hkv, N] with the entry mass of layers first .. L - 1 kept by `sparse_decode_pending` added
    (`gpu.add_pending_mass_gpu`, in place)."""
    from pallas_kernels.block_scores import gpu
    return gpu.add_pending_mass_gpu(indices, pending, heat, group=group, first=first)


def select_blocks(heat: Array | None, ret: Array | None, n_s: Array, hi: Array, nbv: Array, count: Array,
                  full: Array, *, num_kv_heads: int, nb: int, width: int, heat_width: int, layer: Array | None = None,
                  implementation: str | None = None) -> Array:
    """EvoSparse's attended blocks of one decode row, i32[B, Hkv, width] (semantics: `xla.select_blocks_xla`,
    which is also the "reference"). implementation=None: the one-launch Triton kernel on a GPU when nb <= 32768,
    else XLA. With `layer` (i32[]), heat is the stacked heat f32[L, B, Hkv, nb] and row `layer` is read (in place
    by the kernel). Under a mesh, per shard (rows over data, KV heads over model; the retrieval set, one per row,
    replicated over model)."""
    if active_mesh() is not None:
        out = _select_per_shard(
            lambda heat, cand, ret, n_s, hi, nbv, count, full, layer, h: select_blocks(
                heat, ret, n_s, hi, nbv, count, full, num_kv_heads=h, nb=nb, width=width, heat_width=heat_width,
                layer=layer, implementation=implementation),
            heat, None, ret, (n_s, hi, nbv, count, full), layer, num_kv_heads)
        if out is not None:
            return out
    from pallas_kernels.topk_select.gpu_row import ROW_LIMIT
    if implementation is None:
        implementation = "pallas_gpu" if jax.default_backend() == "gpu" and nb <= ROW_LIMIT else "xla"
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}: expected one of {IMPLEMENTATIONS} or None")
    args = (heat, ret, n_s, hi, nbv, count, full)
    kw = dict(num_kv_heads=num_kv_heads, nb=nb, width=width, heat_width=heat_width, layer=layer)
    if implementation == "pallas_gpu":
        from pallas_kernels.block_scores import gpu
        return gpu.select_blocks_gpu(*args, **kw)
    return xla.select_blocks_xla(*args, **kw)


def select_from_candidates(heat: Array, cand: Array, ret: Array | None, n_s: Array, hi: Array, nbv: Array,
                           count: Array, full: Array, *, num_kv_heads: int, width: int, heat_width: int,
                           layer: Array | None = None, count_less_ret: bool = False,
                           implementation: str | None = None) -> Array:
    """`select_blocks` given each row's heat candidates (`xla.heat_candidates`, computed once per decode step
    for every layer): i32[B, Hkv, width], the same blocks (semantics: `xla.select_from_candidates_xla`; with
    count_less_ret, `count` is before the retrieval set's valid entries, subtracted there).
    implementation=None: the Triton kernel on a GPU when the candidates and the retrieval set are at most
    `gpu.CAND_LIMIT` wide (it ranks them pairwise in registers), else XLA. Under a mesh, per shard (see
    `select_blocks`)."""
    if active_mesh() is not None:
        out = _select_per_shard(
            lambda heat, cand, ret, n_s, hi, nbv, count, full, layer, h: select_from_candidates(
                heat, cand, ret, n_s, hi, nbv, count, full, num_kv_heads=h, width=width, heat_width=heat_width,
                layer=layer, count_less_ret=count_less_ret, implementation=implementation),
            heat, cand, ret, (n_s, hi, nbv, count, full), layer, num_kv_heads)
        if out is not None:
            return out
    args = (heat, cand, ret, n_s, hi, nbv, count, full)
    kw = dict(num_kv_heads=num_kv_heads, width=width, heat_width=heat_width, layer=layer,
              count_less_ret=count_less_ret)
    if _candidates_impl(implementation, cand, ret) == "pallas_gpu":
        from pallas_kernels.block_scores import gpu
        return gpu.select_from_candidates_gpu(*args, **kw)
    return xla.select_from_candidates_xla(*args, **kw)


def select_from_plan(heat: Array, cand: Array, ret: Array | None, plan: Array, *, num_kv_heads: int, width: int,
                     heat_width: int, layer: Array | None = None, count_less_ret: bool = False,
                     implementation: str | None = None) -> Array:
    """`select_from_candidates` with the five row arrays as one plan i32[B, gpu.PLAN] (`gpu.make_plan`: n_s, hi,
    nbv, count, full, zeros), made once per decode step: the Triton kernel reads it in place, so a layer runs no
    XLA kernel before the selection. Elsewhere (and under a mesh) the plan is unpacked into
    `select_from_candidates`, the same blocks."""
    if active_mesh() is None and _candidates_impl(implementation, cand, ret) == "pallas_gpu":
        from pallas_kernels.block_scores import gpu
        return gpu.select_from_plan_gpu(heat, cand, ret, plan, num_kv_heads=num_kv_heads, width=width,
                                        heat_width=heat_width, layer=layer, count_less_ret=count_less_ret)
    n_s, hi, nbv, count, full = (plan[:, j] for j in range(5))
    return select_from_candidates(heat, cand, ret, n_s, hi, nbv, count, full != 0, num_kv_heads=num_kv_heads,
                                  width=width, heat_width=heat_width, layer=layer, count_less_ret=count_less_ret,
                                  implementation=implementation)


def select_span(heat: Array, cand: Array, ret: Array | None, plan: Array, out: Array, first: Array, count: Array, *,
                span: int, heat_width: int, count_less_ret: bool = False, implementation: str | None = None) -> Array:
    """`select_from_plan` of the layers first .. first + count - 1 (i32[] each, traced; count <= span static,
    first + count <= L), written into their rows of out i32[L, B, Hkv, width] and returned (the other rows kept):
    heat f32[L, B, Hkv, nb] and cand i32[L, B, Hkv, Wc] stacked, ret and plan shared by the layers. On a GPU one
    launch for them all (`gpu.select_span_gpu`); elsewhere (and under a mesh) `span` masked `select_from_plan`
    calls, the same blocks."""
    L, B, Hkv, width = out.shape
    if active_mesh() is None and _candidates_impl(implementation, cand, ret) == "pallas_gpu":
        from pallas_kernels.block_scores import gpu
        return gpu.select_span_gpu(heat, cand, ret, plan, out, first, count, span=span, heat_width=heat_width,
                                   count_less_ret=count_less_ret)
    for j in range(span):
        row = jnp.minimum(jnp.asarray(first, jnp.int32) + j, L - 1)
        idx = select_from_plan(heat, cand, ret, plan, num_kv_heads=Hkv, width=width, heat_width=heat_width,
                               layer=row, count_less_ret=count_less_ret, implementation=implementation)
        out = jnp.where(j < count, jax.lax.dynamic_update_index_in_dim(out, idx.astype(out.dtype), row, 0), out)
    return out


def _candidates_impl(implementation: str | None, cand: Array, ret: Array | None) -> str:
    """The candidate rank's implementation: None picks the Triton kernel on a GPU when the candidates and the
    retrieval set are at most `gpu.CAND_LIMIT` wide (it ranks them pairwise in registers), else XLA."""
    if implementation is None:
        from pallas_kernels.block_scores.gpu import CAND_LIMIT
        small = cand.shape[-1] <= CAND_LIMIT and (ret is None or ret.shape[-1] <= CAND_LIMIT)
        implementation = "pallas_gpu" if jax.default_backend() == "gpu" and small else "xla"
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}: expected one of {IMPLEMENTATIONS} or None")
    return implementation


def _select_per_shard(call, heat, cand, ret, rows, layer, num_kv_heads: int):
    """call(heat, cand, ret, *rows, layer, local_num_kv_heads) per shard, or None when the KV heads do not divide
    the model axis (the caller then runs unsplit). heat / cand: [B, Hkv, ...] or stacked [L, B, Hkv, ...] (with
    `layer`); ret: [B, Wr] (replicated over model); rows: i32/bool[B] each."""
    m = dict(active_mesh().shape).get(MODEL, 1)
    if num_kv_heads % m:
        return None
    stack = heat if heat is not None else cand
    if layer is not None and stack is not None:
        check_layer(layer, stack.shape[0])  # a known layer is checked here: the shards see it traced
    per_head = dims(4, 1, 2) if layer is not None else dims(3, 0, 1)
    named = [("heat", heat, per_head), ("cand", cand, per_head), ("ret", ret, dims(2, 0)), ("layer", layer, ())]
    present = [(k, a, t) for k, a, t in named if a is not None]
    args = [a for _, a, _ in present] + list(rows)
    templates = [t for _, _, t in present] + [dims(1, 0)] * len(rows)

    def local(*xs):
        got = dict(zip([k for k, _, _ in present], xs))
        split = MODEL in jax.sharding.get_abstract_mesh().manual_axes  # else `per_shard`'s fallback: run whole
        return call(got.get("heat"), got.get("cand"), got.get("ret"), *xs[len(present):], got.get("layer"),
                    num_kv_heads // m if split else num_kv_heads)
    return per_shard(local, args, templates, dims(3, 0, 1))
