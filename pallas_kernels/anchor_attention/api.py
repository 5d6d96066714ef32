"""The entry points `anchor_decode` and `anchor_prefill`, dispatching over implementations.

  implementation=None   pick by `jax.default_backend()`: gpu -> "pallas_gpu" (bf16/f16/f32, D a power of two
                        >= 16, else "xla"), tpu -> "pallas_tpu", anything else -> "xla".
  "pallas_gpu"          `gpu.py` / `gpu_prefill.py`: Triton scoring passes + Triton top-k + Triton gathered
                        attention.
  "pallas_tpu"          `tpu.py` / `tpu_prefill.py`: Pallas TPU scoring passes + TPU top-k counting +
                        sparse_decode / sparse_prefill.
  "xla"                 `xla.py`: einsum scores (prefill: [T, T], as the reference), then the selection and
                        attention entry points (the CPU choice).
  "reference"           `reference.py`: the specification (dense softmax, lax.top_k, reference attention);
                        materialises [T, T] in prefill.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.sharding import active_mesh, dims, per_shard

Array = jax.Array

IMPLEMENTATIONS = ("pallas_gpu", "pallas_tpu", "xla", "reference")


def _pick(implementation: str | None, q: Array) -> str:
    if implementation is None:
        backend = jax.default_backend()
        if backend == "gpu":
            from pallas_kernels.anchor_attention import gpu
            return "xla" if gpu.unsupported_reason(q.dtype, q.shape[-1]) else "pallas_gpu"
        return "pallas_tpu" if backend == "tpu" else "xla"
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}: expected one of {IMPLEMENTATIONS} or None")
    return implementation


def anchor_decode(q: Array, k: Array, v: Array, lengths: Array, *, budget: float, min_tokens: int = 128,
                  K: int | None = None, layer: Array | None = None, scale: float | None = None,
                  dense_output: bool = False, diagonal_tile: int = 0, with_output: bool = True,
                  implementation: str | None = None, config=None) -> tuple[Array | None, Array]:
    """Kascade anchor decode layer: exact pooled post-softmax scores of every visible key, top-k selection,
    attention over the selected keys (or dense attention for a dense anchor).

    Args:
      q: [B, T, Hq, D] queries of the T newest tokens (positions lengths - T + t).
      k, v: [B, Hkv, N, D] head-major cache (new tokens written), or with `layer` the stacked cache
        [L, B, Hkv, N, D] (models.attention.LayerKV's k_all, v_all), which the kernels read in place.
      lengths: int32[B] valid tokens per row.
      budget: kept fraction in (0, 1]: kk = min(max(ceil(budget * (pos + 1)), min_tokens), pos + 1) keys per
        (row, KV head, token).
      min_tokens: the floor of that rule.
      K: static index width (None: the rule at N).
      layer: i32[] (traced) layer of a stacked cache, or None.
      scale: softmax scale (None: 1/sqrt(D)).
      dense_output: attend to every visible key (Kascade's layer 0, dense and an anchor).
      diagonal_tile: 0, or a tile size: each query's own causal diagonal tile (keys floor(pos / tile) * tile
        .. pos) is chosen first, inside the budget (Kascade's decode keeps what its prefill adds to every query
        tile; jsparse.methods.oracle.select_decode).
      with_output: False skips the attention (sparse anchors only) and returns (None, indices), for a caller
        that attends itself (many rows at once through a mask, where gathering T * K rows would cost more).
      implementation: see the module docstring.
      config: tuning of the Pallas GPU implementation (`gpu.AnchorConfig`; None: the default); ignored by the
        others.

    Returns:
      (out: [B, T, Hq, D] in q.dtype (None when with_output is False and not dense_output),
       indices: int32[B, Hkv, T, K] ascending, -1 padded). Under a mesh (`pallas_kernels.sharding`), per shard:
      rows over data, heads over model (the GQA pooling stays within a KV head's group, on one device).
    """
    if active_mesh() is not None:
        kv = dims(5, 1, 2) if layer is not None else dims(4, 0, 1)
        args = [q, k, v, lengths] + ([layer] if layer is not None else [])
        templates = [dims(4, 0, 2), kv, kv, dims(1, 0)] + ([()] if layer is not None else [])
        has_out = with_output or dense_output

        def local(q, k, v, lengths, *rest):
            out, idx = anchor_decode(q, k, v, lengths, budget=budget, min_tokens=min_tokens, K=K,
                                     layer=rest[0] if rest else None, scale=scale, dense_output=dense_output,
                                     diagonal_tile=diagonal_tile, with_output=with_output,
                                     implementation=implementation, config=config)
            return (out, idx) if has_out else idx
        if has_out:
            return per_shard(local, args, templates, (dims(4, 0, 2), dims(4, 0, 1)))
        return None, per_shard(local, args, templates, dims(4, 0, 1))
    impl = _pick(implementation, q)
    kw = dict(budget=budget, min_tokens=min_tokens, K=K, layer=layer, scale=scale, dense_output=dense_output,
              diagonal_tile=diagonal_tile, with_output=with_output)
    if impl == "reference":
        from pallas_kernels.anchor_attention.reference import anchor_decode_reference
        return anchor_decode_reference(q, k, v, lengths, **kw)
    if impl == "xla":
        from pallas_kernels.anchor_attention.xla import anchor_decode_xla
        return anchor_decode_xla(q, k, v, lengths, **kw)
    if impl == "pallas_gpu":
        from pallas_kernels.anchor_attention.gpu import anchor_decode_gpu
        return anchor_decode_gpu(q, k, v, lengths, **kw, **({} if config is None else {"config": config}))
    from pallas_kernels.anchor_attention.tpu import anchor_decode_tpu
    return anchor_decode_tpu(q, k, v, lengths, **kw)


def _pick_prefill(q: Array, tile: int) -> str:
    backend = jax.default_backend()
    if backend == "gpu":
        from pallas_kernels.anchor_attention import gpu
        ok = gpu.unsupported_reason(q.dtype, q.shape[-1]) is None and tile >= 16 and not tile & (tile - 1)
        return "pallas_gpu" if ok else "xla"
    return "pallas_tpu" if backend == "tpu" else "xla"


def anchor_prefill(q: Array, k: Array, v: Array, lengths: Array, *, tile: int, budget: float,
                   min_tokens: int = 128, K: int | None = None, scale: float | None = None,
                   dense_output: bool = False, block_size: int = 1, implementation: str | None = None,
                   config=None) -> tuple[Array, Array]:
    """Kascade anchor prefill layer: causal post-softmax scores pooled over the GQA group and each query tile
    (never materialising [T, T] in the Pallas kernels), top-k per tile among the keys before it, tile-gathered
    attention (or dense causal attention for a dense anchor).

    Args:
      q: [B, T, Hq, D]; k, v: [B, T, Hkv, D]; lengths: int32[B] valid tokens per row.
      tile: query rows per index row (GPU: a power of two >= 16; TPU: a multiple of 8).
      budget, min_tokens: tile i keeps min(max(ceil(budget * i * tile), min_tokens), i * tile) keys.
      K: static index width in keys (None: the rule at T).
      scale: softmax scale (None: 1/sqrt(D)).
      dense_output: dense causal attention (Kascade's layer 0).
      block_size: 1 selects keys (tokens). A power of two dividing `tile` selects key blocks of that many tokens
        (entry j covers tokens j*bs .. j*bs + bs - 1): each block scores the sum of its keys' tile-pooled scores
        (the same pooled scores; [T, T] is still never stored), tile i keeps ceil(kk_i / block_size) blocks
        for the token rule kk_i above (the budget counted in keys and rounded up to whole blocks: at most
        block_size - 1 keys more, never more than the keys before the tile), and the attention gathers blocks
        (`sparse_prefill(..., block_size=...)`: on Hopper, blocks of >= 8 tokens run on the Mosaic GPU kernel).
        The index width is ceil(K / block_size).
      implementation: "pallas_gpu", "pallas_tpu", "xla", "reference" or None (by backend: gpu -> "pallas_gpu"
        when the Triton kernels take the dtype, D and tile (a power of two >= 16), else "xla"; tpu ->
        "pallas_tpu"; else "xla"). "xla" materialises [T, T] scores as the reference does, then the selection
        and attention entry points.
      config: `gpu_prefill.PrefillScoresConfig` for "pallas_gpu" (None: the default); ignored by the others.

    Returns:
      (out: [B, T, Hq, D] in q.dtype, indices: int32[B, Hkv, ceil(T / tile), ceil(K / block_size)] ascending,
      -1 padded, in blocks when block_size > 1). Under a mesh, per shard (see anchor_decode).
    """
    if active_mesh() is not None:
        qs = dims(4, 0, 2)
        return per_shard(lambda q, k, v, lengths: anchor_prefill(
            q, k, v, lengths, tile=tile, budget=budget, min_tokens=min_tokens, K=K, scale=scale,
            dense_output=dense_output, block_size=block_size, implementation=implementation, config=config),
            [q, k, v, lengths], [qs, qs, qs, dims(1, 0)], (qs, dims(4, 0, 1)))
    if implementation is None:
        implementation = _pick_prefill(q, tile)
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}: expected one of {IMPLEMENTATIONS} or None")
    kw = dict(tile=tile, budget=budget, min_tokens=min_tokens, K=K, scale=scale, dense_output=dense_output,
              block_size=block_size)
    if implementation == "reference":
        from pallas_kernels.anchor_attention.reference import anchor_prefill_reference
        return anchor_prefill_reference(q, k, v, lengths, **kw)
    if implementation == "xla":
        from pallas_kernels.anchor_attention.xla import anchor_prefill_xla
        return anchor_prefill_xla(q, k, v, lengths, **kw)
    if implementation == "pallas_gpu":
        from pallas_kernels.anchor_attention.gpu_prefill import PrefillScoresConfig, anchor_prefill_gpu
        # A dense anchor (Kascade's layer 0) takes the rows' logsumexp from cuDNN's dense attention instead of
        # the lse pass (cuDNN: 16-bit inputs, the default scale).
        dense_lse = dense_output and scale is None and q.dtype in (jnp.bfloat16, jnp.float16)
        return anchor_prefill_gpu(q, k, v, lengths, **kw, dense_lse=dense_lse,
                                  config=PrefillScoresConfig() if config is None else config)
    from pallas_kernels.anchor_attention.tpu_prefill import anchor_prefill_tpu
    return anchor_prefill_tpu(q, k, v, lengths, **kw)
