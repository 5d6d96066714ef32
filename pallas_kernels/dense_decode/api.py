"""The entry point `dense_decode_stacked`, dispatching over implementations.

  implementation=None   on a GPU with arguments the kernel takes: "pallas_gpu"; otherwise "sliced".
  "pallas_gpu"          gpu.py: the Pallas Triton split-K kernel reading the layer in place.
  "sliced"              slice the layer (`k_all[layer]`), then `pallas_kernels.dense.dense_decode` (cuDNN on a
                        GPU, XLA elsewhere): what the model did before; XLA copies the slice for cuDNN. Its
                        log-sum-exp (`return_lse`) is a separate XLA computation (`reference.decode_lse`).
  "reference"           reference.py (plain jnp; tests).

Naming an implementation never falls back: arguments it cannot take raise ValueError.

`dense_decode_record` (one new token per row, its logits written into a stacked record buffer, and their block
maxima: the STS draft's recording step) dispatches the same way ("sliced": `dense_decode` on the slice, the record
and the log-sum-exp in XLA).
"""

from __future__ import annotations

import jax

from pallas_kernels import dense
from pallas_kernels.dense_decode import reference
from pallas_kernels.sharding import active_mesh, dims, per_shard

Array = jax.Array

IMPLEMENTATIONS = ("pallas_gpu", "sliced", "reference")
# The Pallas GPU kernel's `gpu.DenseDecodeConfig` per head_dim, overriding its default there (absent:
# `gpu.default_config(head_dim)`); read when traced. A knob for tuning in the model
# (eval/results/h200/dense_decode_d64/).
CONFIGS: dict = {}


def _unsupported_reason(implementation: str, q: Array) -> str | None:
    if implementation == "pallas_gpu":
        from pallas_kernels.dense_decode import gpu
        return gpu.unsupported_reason(q.dtype, q.shape[-1])
    return None


def _pick(implementation: str | None, q: Array) -> str:
    """The implementation that runs (None: "pallas_gpu" on a GPU where the kernel takes q, else "sliced"); one named
    that is unknown or cannot take q is a ValueError."""
    if implementation is None:
        on_gpu = jax.default_backend() == "gpu"
        return "pallas_gpu" if on_gpu and supported("pallas_gpu", q) else "sliced"
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}: expected one of {IMPLEMENTATIONS} or None")
    reason = _unsupported_reason(implementation, q)
    if reason is not None:
        raise ValueError(f"implementation={implementation!r} cannot run this call: {reason}")
    return implementation


def supported(implementation: str, q: Array) -> bool:
    """Whether `implementation` can run on queries like q: [B, T, Hq, D]."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}: expected one of {IMPLEMENTATIONS}")
    return _unsupported_reason(implementation, q) is None


def dense_decode_stacked(q: Array, k_all: Array, v_all: Array, layer: Array, lengths: Array, *,
                         return_lse: bool = False, return_probs: bool = False, implementation: str | None = None):
    """Dense decode attention of the T newest tokens over layer `layer` of a stacked head-major cache.

    Args:
      q: [B, T, Hq, D] queries of the tokens at positions lengths - T .. lengths - 1.
      k_all: [L, B, Hkv, N, D] stacked key cache (the new tokens already written).
      v_all: [L, B, Hkv, N, D] stacked value cache.
      layer: i32[] (traced) layer to read, as `k_all[layer]`.
      lengths: i32[B] valid tokens per row.
      return_lse: also return each query row's log-sum-exp of its scaled visible logits.
      return_probs: also return each query head's post-softmax weights over the keys, summed over the T queries
        (`reference.decode_probs_reference`, `pallas_kernels.head_probs`'s weights; "pallas_gpu" takes them from
        the logits its kernel computes, without reading K again; the others compute the log-sum-exp first).
      implementation: see the module docstring.

    Returns:
      [B, T, Hq, D] in q.dtype, equal to `pallas_kernels.dense.dense_decode(q, k_all[layer], v_all[layer],
      lengths)`; with return_lse and / or return_probs a tuple: that, then lse f32[B, T, Hq] (-inf for a row with
      no visible key), then probs f32[B, Hq, N] (0 at the keys a query does not see).
    """
    reference.check_args(q, k_all, v_all, layer, lengths)
    if active_mesh() is not None:  # per shard (pallas_kernels.sharding): rows over data, heads over model
        qs, kv = dims(4, 0, 2), dims(5, 1, 2)
        outs = (qs,) + ((dims(3, 0, 2),) if return_lse else ()) + ((dims(3, 0, 1),) if return_probs else ())
        return per_shard(lambda q, k, v, layer, lengths: dense_decode_stacked(
            q, k, v, layer, lengths, return_lse=return_lse, return_probs=return_probs,
            implementation=implementation),
            [q, k_all, v_all, layer, lengths], [qs, kv, kv, (), dims(1, 0)], outs if len(outs) > 1 else qs)
    implementation = _pick(implementation, q)
    if implementation == "pallas_gpu":
        from pallas_kernels.dense_decode import gpu
        config = CONFIGS.get(q.shape[-1])
        return gpu.dense_decode_stacked_gpu(q, k_all, v_all, layer, lengths, return_lse=return_lse,
                                            return_probs=return_probs, config=config)
    if implementation == "reference":
        out, lse = reference.dense_decode_stacked_reference(q, k_all, v_all, layer, lengths, return_lse=True)
    else:
        k = reference.select_layer(k_all, layer)
        out = dense.dense_decode(q, k, reference.select_layer(v_all, layer), lengths)
        lse = reference.decode_lse(q, k, lengths) if (return_lse or return_probs) else None
    res = (out,) + ((lse,) if return_lse else ())
    if return_probs:
        res += (reference.decode_probs_reference(q, k_all, layer, lengths, lse),)
    return res if len(res) > 1 else out


def dense_decode_record(q: Array, k_all: Array, v_all: Array, layer: Array, lengths: Array, record: Array,
                        bmax: Array, record_layer: Array, *, block: int = 16, implementation: str | None = None):
    """Dense decode of one new token per row that also writes each query head's scaled logits into row
    `record_layer` of a stacked record buffer and their maxima per block of `block` keys into bmax.

    Args:
      q: [B, 1, Hq, D]; k_all, v_all: [L, B, Hkv, N, D] (the new tokens written); layer: i32[] the cache's layer;
      lengths: i32[B]; record: f32[B, Hq, Lw, N] and bmax: f32[B, Hq, Lw, ceil(N / block)] (updated in place on a
      GPU: do not reuse the arguments); record_layer: i32[] their layer; block: a power of two (<= the kernel's
      block_k on a GPU); implementation: as `dense_decode_stacked`'s.

    Returns:
      (out [B, 1, Hq, D], lse f32[B, Hq], record, bmax) as `reference.dense_decode_record_reference`:
      record[b, h, record_layer, n] = the scaled logit of key n for n < lengths[b] (the rest of the row kept),
      bmax[b, h, record_layer] the largest of them per block (-inf for a block without one), exp(logit - lse)
      their post-softmax weights.
    """
    reference.check_args(q, k_all, v_all, layer, lengths)
    reference.check_record_args(q, k_all, record, bmax, block)
    if active_mesh() is not None:  # per shard: rows over data, heads over model
        kv, rec = dims(5, 1, 2), dims(4, 0, 1)
        return per_shard(lambda q, k, v, layer, lengths, record, bmax, record_layer: dense_decode_record(
            q, k, v, layer, lengths, record, bmax, record_layer, block=block, implementation=implementation),
            [q, k_all, v_all, layer, lengths, record, bmax, record_layer],
            [dims(4, 0, 2), kv, kv, (), dims(1, 0), rec, rec, ()], (dims(4, 0, 2), dims(2, 0, 1), rec, rec))
    implementation = _pick(implementation, q)
    if implementation == "pallas_gpu":
        from pallas_kernels.dense_decode import gpu
        return gpu.dense_decode_record_gpu(q, k_all, v_all, layer, lengths, record, bmax, record_layer, block=block,
                                           config=CONFIGS.get(q.shape[-1]))
    if implementation == "reference":
        return reference.dense_decode_record_reference(q, k_all, v_all, layer, lengths, record, bmax, record_layer,
                                                       block=block)
    k = reference.select_layer(k_all, layer)
    out = dense.dense_decode(q, k, reference.select_layer(v_all, layer), lengths)
    record, bmax = reference.write_record(q, k, lengths, record, bmax, record_layer, block)
    return out, reference.decode_lse(q, k, lengths)[:, 0], record, bmax
