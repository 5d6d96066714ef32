"""``logit_mse``: TokenButler's training loss, blockwise, with a custom VJP for the predictor's side.

TokenButler trains a small predictor whose logits ``p = q' k'^T / sqrt(d')`` should match the frozen
model's pre-softmax logits ``s = q k^T / sqrt(d)`` for every layer >= 1 and every head. Materialising
``s`` and ``p`` costs ``O(layers * heads * L^2)`` memory; this entry point computes the mean of
``(s - p)^2`` tile by tile (flash-attention style) and never writes an ``L x L`` array, forward or
backward.

Dispatch (``implementation``):
  * ``"gpu"``: Pallas, Triton backend (gpu.py). Default on GPU.
  * ``"tpu"``: Pallas, Mosaic TPU backend (tpu.py). Default on TPU.
  * ``"xla"``: the materialised jnp reference (reference.py). Default elsewhere (CPU); memory grows as L^2.
``interpret=True`` runs the chosen Pallas kernel in the interpreter (for CPU tests).

Gradients (``jax.custom_vjp``): with ``e = p - s`` and ``n`` counted pairs, and ``g`` the cotangent of
the per-head loss,
  dL/dq'_i = g * 2 / (n sqrt(d')) * sum_j e_ij k'_j,      dL/dk'_j = g * 2 / (n sqrt(d')) * sum_i e_ij q'_i.
The forward pass of the VJP accumulates ``sum_j e_ij k'_j`` while it already has each tile, so the
backward pass only runs the key-side kernel. ``q`` and ``k`` (the frozen model) get a symbolic zero
cotangent (the bwd rule returns ``None`` for them): ``jax.grad`` with respect to them is all zeros and
no kernel runs for them. The ``"xla"`` path applies ``lax.stop_gradient`` to ``q`` and ``k`` so that it
has the same semantics.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.logit_mse import gpu, tpu
from pallas_kernels.logit_mse.reference import check_shapes, logit_mse_reference, num_pairs

Array = jax.Array

IMPLEMENTATIONS = ("gpu", "tpu", "xla")

# Default tiles. GPU: 128 query rows x 64 keys, 4 warps (the Triton flash-attention choice for d = 64 on
# Hopper; eval/bench/logit_mse.py sweeps alternatives). TPU: 512 x 512, to amortise the ~0.35 us
# per-grid-step overhead; both shrink for short sequences (never below the backend's minimum).
_GPU_BLOCKS = (128, 64)
_TPU_BLOCKS = (512, 512)


@dataclasses.dataclass(frozen=True)
class _Config:
    causal: bool
    block_q: int
    block_k: int
    implementation: str
    interpret: bool


def _default_implementation() -> str:
    backend = jax.default_backend()
    return {"gpu": "gpu", "tpu": "tpu"}.get(backend, "xla")


def _default_block(impl: str, which: int, L: int) -> int:
    if impl == "tpu":
        return min(_TPU_BLOCKS[which], max(128, -(-L // 128) * 128))
    return min(_GPU_BLOCKS[which], max(16, 1 << (L - 1).bit_length()))


def _kernels(cfg: _Config):
    if cfg.implementation == "gpu":
        return gpu.logit_mse_fwd_gpu, gpu.logit_mse_dkp_gpu
    return tpu.logit_mse_fwd_tpu, tpu.logit_mse_dkp_tpu


def _kw(cfg: _Config) -> dict:
    return dict(causal=cfg.causal, block_q=cfg.block_q, block_k=cfg.block_k, interpret=cfg.interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _logit_mse_blockwise(q: Array, k: Array, qp: Array, kp: Array, cfg: _Config) -> Array:
    fwd, _ = _kernels(cfg)
    sq_err, _ = fwd(q, k, qp, kp, with_dqp=False, **_kw(cfg))
    return sq_err / num_pairs(q.shape[2], cfg.causal)


def _logit_mse_blockwise_fwd(q, k, qp, kp, cfg: _Config):
    """Loss and the unscaled dq' accumulator (f32[B, Hq, L, dp]) in one pass over the tiles."""
    fwd, _ = _kernels(cfg)
    sq_err, dqp_raw = fwd(q, k, qp, kp, with_dqp=True, **_kw(cfg))
    return sq_err / num_pairs(q.shape[2], cfg.causal), (q, k, qp, kp, dqp_raw)


def _logit_mse_blockwise_bwd(cfg: _Config, residuals, g):
    """Cotangents (None, None, dq', dk') for a per-head cotangent g: f32[B, Hq]."""
    q, k, qp, kp, dqp_raw = residuals
    _, dkp_kernel = _kernels(cfg)
    dkp_raw = dkp_kernel(q, k, qp, kp, **_kw(cfg))  # f32[B, Hq, L, dp], one row per query head
    B, Hq, L, dp = qp.shape
    Hkp = kp.shape[1]
    w = (g.astype(jnp.float32) * (2.0 / (num_pairs(L, cfg.causal) * math.sqrt(dp))))[:, :, None, None]
    dqp = (w * dqp_raw).astype(qp.dtype)
    dkp = w * dkp_raw
    if Hkp != Hq:  # kp head c serves query heads c * Gp .. c * Gp + Gp - 1
        dkp = dkp.reshape(B, Hkp, Hq // Hkp, L, dp).sum(axis=2)
    return None, None, dqp, dkp.astype(kp.dtype)


_logit_mse_blockwise.defvjp(_logit_mse_blockwise_fwd, _logit_mse_blockwise_bwd)


def logit_mse(
    q: Array,
    k: Array,
    qp: Array,
    kp: Array,
    *,
    causal: bool = True,
    block_q: int | None = None,
    block_k: int | None = None,
    implementation: str | None = None,
    interpret: bool = False,
) -> Array:
    """Per-head mean squared error between a frozen model's logits and a predictor's, blockwise.

    ``loss[b, h] = mean over counted pairs (i, j) of (q_i . k_j / sqrt(d) - q'_i . k'_j / sqrt(d'))^2``.

    Layers: the loss is per head, so several layers are handled by stacking them into the head axis
    (``[layers, B, L, H, d] -> [B, layers * H, L, d]``, layer-major) or into the batch axis
    (``[layers * B, H, L, d]``); the result is then reshaped back and averaged by the caller. Stacking
    into the head axis keeps GQA right: with ``q`` heads ``l * Hq + h`` and ``k`` heads ``l * Hkv + c``,
    ``(l * Hq + h) // G == l * Hkv + h // G``.

    Why ``causal=True`` is the default: at decode a query only ever attends to (and the predictor only
    ever ranks) keys at positions ``j <= i``; the logits of future keys are masked out of the softmax
    and never used, so fitting them spends the predictor's small capacity on targets that do not
    affect token selection. It also halves the work (tiles above the diagonal are skipped). The
    official TokenButler code averages over all ``L * L`` pairs; ``causal=False`` reproduces that.

    Args:
      q: [B, Hq, L, d] the frozen model's queries for one layer per head slot (after RoPE); bf16 or f32.
      k: [B, Hkv, L, d] the frozen model's keys (after RoPE), same dtype as q; query head h uses key
        head ``h // (Hq // Hkv)`` (GQA). Gets no gradient.
      qp: [B, Hq, L, d'] the predictor's queries.
      kp: [B, Hkp, L, d'] the predictor's keys, same dtype as qp; ``Hkp`` divides ``Hq`` (``Hq`` or
        ``Hkv`` in practice), query head h uses ``h // (Hq // Hkp)``.
      causal: average over the ``L (L + 1) / 2`` pairs ``j <= i`` (True) or all ``L * L`` pairs (False).
      block_q, block_k: tile sizes (GPU: powers of two >= 16; TPU: multiples of 8). L need not be a
        multiple: inputs are zero-padded to one, which adds exactly zero to the loss. Default: GPU
        128 x 64, TPU 512 x 512, shrunk for short L. Ignored by ``"xla"``.
      implementation: ``"gpu"``, ``"tpu"``, ``"xla"`` or None (by ``jax.default_backend()``).
      interpret: run the Pallas kernel in the interpreter (tests on CPU).

    Returns:
      f32[B, Hq] per-head mean. Matmuls run in the inputs' dtype and accumulate in f32; all sums are f32.
      Differentiable in ``qp`` and ``kp`` (gradients in their dtypes); ``q`` and ``k`` get zero gradient.
    """
    B, Hq, Hkv, Hkp, L, d, dp = check_shapes(q, k, qp, kp)
    for name, x in (("q", q), ("k", k), ("qp", qp), ("kp", kp)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must be a floating dtype, got {x.dtype}")
    impl = implementation or _default_implementation()
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r} must be one of {IMPLEMENTATIONS} or None")
    if impl == "xla":
        return logit_mse_reference(lax.stop_gradient(q), lax.stop_gradient(k), qp, kp, causal=causal)
    if q.dtype != k.dtype:
        raise TypeError(f"q and k must share a dtype for the kernel, got {q.dtype} and {k.dtype}")
    if qp.dtype != kp.dtype:
        raise TypeError(f"qp and kp must share a dtype for the kernel, got {qp.dtype} and {kp.dtype}")
    cfg = _Config(
        causal=bool(causal),
        block_q=block_q if block_q is not None else _default_block(impl, 0, L),
        block_k=block_k if block_k is not None else _default_block(impl, 1, L),
        implementation=impl,
        interpret=bool(interpret),
    )
    return _logit_mse_blockwise(q, k, qp, kp, cfg)
