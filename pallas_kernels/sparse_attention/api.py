"""One entry point per op: `sparse_decode` and `sparse_prefill`, dispatching over implementations.

  implementation=None       pick by `jax.default_backend()`: gpu -> "pallas_gpu" (prefill over block selections
                            that the Mosaic GPU kernel takes on a Hopper GPU -> "mosaic_gpu"), tpu -> "pallas_tpu",
                            anything else -> "xla"; when the picked kernel cannot take the arguments (see
                            `supported`), fall back to "xla".
  "xla"                     `xla.py`: take_along_axis gathers + einsums (any backend).
  "pallas_gpu"              `gpu.py`: Pallas Triton kernels (split-K gathered decode, tile-gathered prefill).
  "mosaic_gpu"              `mgpu_prefill.py`: the Pallas Mosaic GPU prefill kernel (Hopper: TMA + WGMMA) over block
                            selections (block_size a power of two >= 8, tile 32/64/128, bf16/f16, D 64/128,
                            G * tile a multiple of 64); prefill only; picked by default on Hopper when it takes
                            the call (token-level selections run on "pallas_gpu").
  "pallas_tpu"              `tpu.py`: Pallas TPU kernels at block granularity (block_size % 8 == 0).
  "reference"               `reference.py`: the plain-jnp specification (slow; tests only).

Naming an implementation explicitly never falls back: arguments it cannot take raise ValueError.
The semantics (index contract, masking, empty rows) are those of `reference.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.layers import check_layer, select_layer
from pallas_kernels.sharding import active_mesh, dims, per_shard
from pallas_kernels.sparse_attention import reference, xla
from pallas_kernels.sparse_attention.common import check_decode_args, query_rows

Array = jax.Array

IMPLEMENTATIONS = ("xla", "pallas_gpu", "mosaic_gpu", "pallas_tpu", "reference")
# The stacked Pallas GPU decode kernel's `gpu.DecodeConfig` in `sparse_decode(layer=...)` (None: its default); read
# when traced.
STACKED_DECODE_CONFIG = None


def _unsupported_reason(implementation: str, q: Array, block_size: int, tile: int | None,
                        group: int | None = None) -> str | None:
    """Why `implementation` cannot run these arguments (None when it can); group: G = Hq / Hkv (None: not
    checked)."""
    D = q.shape[-1]
    if implementation == "pallas_gpu":
        from pallas_kernels.sparse_attention import gpu
        return gpu.unsupported_reason(q.dtype, D, block_size, tile)
    if implementation == "mosaic_gpu":
        from pallas_kernels.sparse_attention import mgpu_prefill
        reason = mgpu_prefill.unsupported_reason(q.dtype, D, block_size, tile, group)
        if reason is None and not mgpu_prefill.hopper():
            reason = (f"a {jax.devices()[0].platform} device (the Mosaic GPU kernel needs a CUDA GPU of compute "
                      f"capability 9.x, Hopper)")
        return reason
    if implementation == "pallas_tpu":
        from pallas_kernels.sparse_attention import tpu
        return tpu.unsupported_reason(q.dtype, D, block_size, tile)
    return None


def supported(implementation: str, q: Array, *, block_size: int = 1, tile: int | None = None,
              group: int | None = None) -> bool:
    """Whether `implementation` can run an op on queries like `q` (tile=None: decode; group: G = Hq / Hkv, None:
    not checked)."""
    return _unsupported_reason(implementation, q, block_size, tile, group) is None


def _pick(implementation: str | None, q: Array, block_size: int, tile: int | None,
          group: int | None = None) -> str:
    """The implementation that runs a call (tile None: decode; group: G = Hq / Hkv, for the Mosaic GPU kernel)."""
    if implementation is None:
        backend = jax.default_backend()
        choice = {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}.get(backend, "xla")
        if (backend == "gpu" and tile is not None and block_size > 1
                and _unsupported_reason("mosaic_gpu", q, block_size, tile, group) is None):
            return "mosaic_gpu"  # block selections on Hopper: TMA block gathers + WGMMA
        if _unsupported_reason(choice, q, block_size, tile) is not None:
            choice = "xla"
        return choice
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}: expected one of {IMPLEMENTATIONS} or None")
    reason = _unsupported_reason(implementation, q, block_size, tile, group)
    if reason is not None:
        raise ValueError(f"implementation={implementation!r} cannot run this call: {reason}")
    return implementation


def _decode_shards(q, k, v, indices, lengths, layer):
    """(operands, `per_shard` templates) of a decode call: rows over data, heads (of q, the cache and the index
    rows) over model; the layer index, when given, last and replicated."""
    if layer is not None:
        check_layer(layer, k.shape[0])  # a known layer is checked here: the shards see it traced
    kv = dims(5, 1, 2) if layer is not None else dims(4, 0, 1)
    args = [q, k, v, indices, lengths] + ([layer] if layer is not None else [])
    return args, [dims(4, 0, 2), kv, kv, dims(4, 0, 1), dims(1, 0)] + ([()] if layer is not None else [])


def head_map_row(head_map: Array, layer) -> Array:
    """The head map of `layer` (every layer's map [L, Hkv], row `layer` as the stacked cache is indexed) or the
    one layer's map [Hkv] as it is."""
    return select_layer(head_map, layer) if jnp.ndim(head_map) == 2 else head_map


def sparse_decode(q: Array, k: Array, v: Array, indices: Array, lengths: Array, *, layer: Array | None = None,
                  block_size: int = 1, scale: float | None = None, return_lse: bool = False,
                  head_map: Array | None = None, implementation: str | None = None) -> Array | tuple[Array, Array]:
    """Gathered decode attention over the selected blocks of a head-major cache.

    Args:
      q: [B, T, Hq, D] queries of the T newest tokens (positions lengths - T + t).
      k: [B, Hkv, N, D] key cache (new tokens written), N % block_size == 0; with `layer`, the stacked cache
        of every layer, [L, B, Hkv, N, D], of which layer `layer` is read.
      v: [B, Hkv, N, D] value cache (or [L, B, Hkv, N, D] with `layer`).
      indices: int32[B, Hkv, T, K] selected blocks (units of block_size tokens), unique, -1 padded. Decode adds
        no causal diagonal (unlike `sparse_prefill`): a query attends to exactly these blocks, so a method lists
        the query's own block itself (as `jsparse.methods.common.topk_decode` does with its diagonal tile).
        Or [B, Hkv, 1, K]: one row for all T queries (each still masked at its own position), as the broadcast
        row; the stacked Pallas GPU kernel (`layer` given, no head_map, T x G at most `stacked.SHARED_MAX_ROWS`)
        then reads each selected key once for the T queries (one program over the T x G query rows of a KV head)
        instead of once per query; every other path broadcasts the row.
      lengths: int32[B] valid tokens per row.
      layer: i32[] in [-L, L) (traced, or a known value, which is checked) or None. Given, k and v are stacked and the op equals the call on k[layer],
        v[layer]; the Pallas kernels read that layer in place (stacked.py), where a slice handed to a kernel
        would be copied by XLA; XLA and the reference slice.
      block_size: tokens per index entry.
      scale: softmax scale (None: 1/sqrt(D)).
      return_lse: also return f32[B, T, Hq] logsumexp over the attended keys.
      head_map: i32[Hkv] or None: KV head h attends over the index row of KV head head_map[h] (as
        `jnp.take(indices, head_map, axis=1)`; the stacked Pallas GPU kernel reads the rows in place). With
        `layer` also every layer's map i32[L, Hkv], of which row `layer` is used (the stacked Pallas GPU kernel
        reads that row itself: no XLA op on the map in a layer scan).
      implementation: see the module docstring.

    Returns:
      [B, T, Hq, D] in q.dtype (zeros for a query with no valid key), and lse with return_lse.

    Under a mesh (`pallas_kernels.sharding`) the op runs per shard (rows over data, heads over model); a
    `head_map` is applied first, outside the shards (its take over the head axis reads other devices' rows).
    """
    if head_map is not None:
        from pallas_kernels.sparse_attention.stacked import check_head_map
        check_head_map(head_map, indices.shape[1], None if layer is None else k.shape[0])
    if active_mesh() is not None:
        if head_map is not None:
            indices = jnp.take(indices, head_map_row(head_map, layer), axis=1, mode="clip")  # clipped, as the kernel
        args, templates = _decode_shards(q, k, v, indices, lengths, layer)
        outs = (dims(4, 0, 2), dims(3, 0, 2)) if return_lse else dims(4, 0, 2)

        def local(q, k, v, indices, lengths, *rest):
            return sparse_decode(q, k, v, indices, lengths, layer=rest[0] if rest else None, block_size=block_size,
                                 scale=scale, return_lse=return_lse, implementation=implementation)
        return per_shard(local, args, templates, outs)
    impl = _pick(implementation, q, block_size, None)
    kw = dict(block_size=block_size, scale=scale, return_lse=return_lse)
    if head_map is not None and not (layer is not None and impl == "pallas_gpu"):
        indices = jnp.take(indices, head_map_row(head_map, layer), axis=1, mode="clip")  # clipped, as the kernel does
        head_map = None
    if layer is not None:
        from pallas_kernels.sparse_attention import stacked
        stacked.check_stacked_args(q, k, v, layer, indices, lengths, block_size, shared_rows=True)
    else:
        check_decode_args(q, k, v, indices, lengths, block_size, shared_rows=True)
    if not (layer is not None and impl == "pallas_gpu"):  # one row for all T queries: the stacked GPU kernel's alone
        indices = query_rows(indices, q.shape[1])
    if layer is not None:
        if impl == "pallas_gpu":
            if STACKED_DECODE_CONFIG is not None:
                kw["config"] = STACKED_DECODE_CONFIG
            return stacked.sparse_decode_stacked_gpu(q, k, v, layer, indices, lengths, head_map=head_map, **kw)
        if impl == "pallas_tpu":
            return stacked.sparse_decode_stacked_tpu(q, k, v, layer, indices, lengths, **kw)
        k, v = stacked.select_layer(k, layer), stacked.select_layer(v, layer)
    if impl == "xla":
        return xla.sparse_decode_xla(q, k, v, indices, lengths, **kw)
    if impl == "reference":
        return reference.sparse_decode_reference(q, k, v, indices, lengths, **kw)
    if impl == "pallas_gpu":
        from pallas_kernels.sparse_attention import gpu
        return gpu.sparse_decode_gpu(q, k, v, indices, lengths, **kw)
    from pallas_kernels.sparse_attention import tpu
    return tpu.sparse_decode_tpu(q, k, v, indices, lengths, **kw)


def sparse_decode_query_heads(q: Array, k: Array, v: Array, indices: Array, lengths: Array, *,
                              layer: Array | None = None, block_size: int = 1, scale: float | None = None,
                              implementation: str | None = None) -> Array:
    """`sparse_decode` where every query head has its own index row (Quest's pages, TokenButler's keys).

    Args as `sparse_decode`, except indices: int32[B, Hq, T, K], row h for query head h (which reads KV head
    h // G, G = Hq / Hkv).

    On the stacked Pallas GPU kernel (`layer` given) this is one launch over the query heads
    (`stacked.sparse_decode_stacked_gpu(..., query_heads=True)`). Elsewhere it is one `sparse_decode` per position
    g of the GQA group: query head g of every KV head, with that head's rows. Under a mesh it runs per shard, rows
    over data and heads over model; query heads split in the same blocks as their KV heads.
    """
    B, T, Hq, D = q.shape
    Hkv = k.shape[-3]
    if indices.ndim != 4 or indices.shape[:3] != (B, Hq, T):
        raise ValueError(f"indices has shape {tuple(indices.shape)}: expected one row per query head "
                         f"[B={B}, Hq={Hq}, T={T}, K]")
    if Hq % Hkv:
        raise ValueError(f"q has {Hq} heads and the cache {Hkv}: expected Hq a multiple of Hkv")
    if active_mesh() is not None:
        args, templates = _decode_shards(q, k, v, indices, lengths, layer)

        def local(q, k, v, indices, lengths, *rest):
            return sparse_decode_query_heads(q, k, v, indices, lengths, layer=rest[0] if rest else None,
                                             block_size=block_size, scale=scale, implementation=implementation)
        return per_shard(local, args, templates, dims(4, 0, 2))
    impl = _pick(implementation, q, block_size, None)
    if layer is not None and impl == "pallas_gpu":
        from pallas_kernels.sparse_attention import stacked
        kw = {} if STACKED_DECODE_CONFIG is None else {"config": STACKED_DECODE_CONFIG}
        return stacked.sparse_decode_stacked_gpu(q, k, v, layer, indices, lengths, block_size=block_size,
                                                 scale=scale, query_heads=True, **kw)
    G = Hq // Hkv
    idx = indices.reshape(B, Hkv, G, T, indices.shape[-1])
    qg = q.reshape(B, T, Hkv, G, D)
    outs = [sparse_decode(qg[:, :, :, g], k, v, idx[:, :, g], lengths, layer=layer, block_size=block_size,
                          scale=scale, implementation=impl) for g in range(G)]
    return jnp.stack(outs, axis=3).reshape(B, T, Hq, D)


def sparse_prefill(q: Array, k: Array, v: Array, indices: Array, lengths: Array, *, tile: int = 32,
                   block_size: int = 1, scale: float | None = None,
                   implementation: str | None = None) -> Array:
    """Tile-gathered causal prefill attention: each query tile's selected blocks plus its diagonal tile.

    Args:
      q: [B, T, Hq, D] queries (positions 0 .. T-1, right padded).
      k: [B, T, Hkv, D] keys.
      v: [B, T, Hkv, D] values.
      indices: int32[B, Hkv, ceil(T/tile), K] selected blocks per query tile (entries at or after the tile
        start are ignored), unique, -1 padded.
      lengths: int32[B] valid tokens per row.
      tile: query rows per index row (a multiple of block_size).
      block_size: tokens per index entry.
      scale: softmax scale (None: 1/sqrt(D)).
      implementation: see the module docstring (None on a Hopper GPU: "mosaic_gpu" for block selections it
        takes, e.g. block_size 16 or 64 at tile 128 with bf16 and D 128; "pallas_gpu" otherwise).

    Returns:
      [B, T, Hq, D] in q.dtype; rows at or beyond lengths are zeros. Under a mesh, per shard (see sparse_decode).
    """
    if active_mesh() is not None:
        qs, kv = dims(4, 0, 2), dims(4, 0, 2)
        return per_shard(lambda q, k, v, indices, lengths: sparse_prefill(
            q, k, v, indices, lengths, tile=tile, block_size=block_size, scale=scale, implementation=implementation),
            [q, k, v, indices, lengths], [qs, kv, kv, dims(4, 0, 1), dims(1, 0)], qs)
    group = q.shape[2] // k.shape[2] if q.ndim == 4 and k.ndim == 4 and k.shape[2] else None
    impl = _pick(implementation, q, block_size, tile, group)
    kw = dict(tile=tile, block_size=block_size, scale=scale)
    if impl == "xla":
        return xla.sparse_prefill_xla(q, k, v, indices, lengths, **kw)
    if impl == "reference":
        return reference.sparse_prefill_reference(q, k, v, indices, lengths, **kw)
    if impl == "pallas_gpu":
        from pallas_kernels.sparse_attention import gpu
        return gpu.sparse_prefill_gpu(q, k, v, indices, lengths, **kw)
    if impl == "mosaic_gpu":
        from pallas_kernels.sparse_attention import mgpu_prefill
        return mgpu_prefill.sparse_prefill_mgpu(q, k, v, indices, lengths, **kw)
    from pallas_kernels.sparse_attention import tpu
    return tpu.sparse_prefill_tpu(q, k, v, indices, lengths, **kw)
