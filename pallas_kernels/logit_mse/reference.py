"""The specification of TokenButler's logit-MSE loss in plain jnp (materialises L x L logits).

For one head, with the frozen model's logits ``s = q k^T / sqrt(d)`` and the predictor's
``p = q' k'^T / sqrt(d')`` (both ``[L, L]``), the loss is the mean of ``(s - p)^2`` over the counted
query-key pairs: all ``L * L`` pairs (``causal=False``) or the ``L (L + 1) / 2`` pairs with ``j <= i``
(``causal=True``). The blockwise kernels (gpu.py, tpu.py) compute the same number without writing
any ``L x L`` array; this module is what they are tested against. It is differentiable by ordinary
autodiff, in every argument.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

Array = jax.Array


def check_shapes(q: Array, k: Array, qp: Array, kp: Array) -> tuple[int, int, int, int, int, int, int]:
    """Validates the four operands and returns ``(B, Hq, Hkv, Hkp, L, d, dp)``.

    Args:
      q: [B, Hq, L, d] queries of the frozen model (after RoPE).
      k: [B, Hkv, L, d] keys of the frozen model (after RoPE); ``Hq % Hkv == 0``.
      qp: [B, Hq, L, dp] the predictor's queries.
      kp: [B, Hkp, L, dp] the predictor's keys; ``Hq % Hkp == 0`` (``Hkp`` is ``Hq`` or ``Hkv`` in practice).
    """
    for name, x in (("q", q), ("k", k), ("qp", qp), ("kp", kp)):
        if x.ndim != 4:
            raise ValueError(f"{name} must be rank 4 [B, H, L, d], got shape {x.shape}")
    B, Hq, L, d = q.shape
    _, Hkv, _, _ = k.shape
    _, _, _, dp = qp.shape
    Hkp = kp.shape[1]
    if k.shape[0] != B or qp.shape[0] != B or kp.shape[0] != B:
        raise ValueError(f"batch sizes differ: q {q.shape}, k {k.shape}, qp {qp.shape}, kp {kp.shape}")
    if k.shape[2] != L or qp.shape[2] != L or kp.shape[2] != L:
        raise ValueError(
            f"sequence lengths differ: q {q.shape}, k {k.shape}, qp {qp.shape}, kp {kp.shape}; all must be L={L}"
        )
    if k.shape[3] != d:
        raise ValueError(f"k's head dim {k.shape[3]} must equal q's {d} (q {q.shape}, k {k.shape})")
    if kp.shape[3] != dp:
        raise ValueError(f"kp's head dim {kp.shape[3]} must equal qp's {dp} (qp {qp.shape}, kp {kp.shape})")
    if qp.shape[1] != Hq:
        raise ValueError(f"qp must have the Hq={Hq} heads of q, got shape {qp.shape}")
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"k's head count Hkv={Hkv} must divide q's Hq={Hq}")
    if Hkp < 1 or Hq % Hkp:
        raise ValueError(f"kp's head count Hkp={Hkp} must divide q's Hq={Hq}")
    if L < 1:
        raise ValueError(f"sequence length L={L} must be >= 1")
    return B, Hq, Hkv, Hkp, L, d, dp


def num_pairs(L: int, causal: bool) -> int:
    """Number of (query, key) pairs the mean runs over: ``L*(L+1)/2`` if causal else ``L*L``."""
    return L * (L + 1) // 2 if causal else L * L


def logit_mse_reference(q: Array, k: Array, qp: Array, kp: Array, *, causal: bool = True) -> Array:
    """Per-head mean squared error between the model's and the predictor's pre-softmax logits.

    Materialises ``[B, Hq, L, L]`` f32 logits: the specification, and the baseline the benchmark
    compares the blockwise kernels with. Matmuls take the inputs' dtype and accumulate in f32.

    Args:
      q: [B, Hq, L, d] frozen model's queries (after RoPE), any float dtype.
      k: [B, Hkv, L, d] frozen model's keys; query head h uses key head ``h // (Hq // Hkv)``.
      qp: [B, Hq, L, dp] predictor's queries.
      kp: [B, Hkp, L, dp] predictor's keys; query head h uses ``h // (Hq // Hkp)``.
      causal: mean over the pairs ``j <= i`` only (True) or over all ``L * L`` pairs (False).

    Returns:
      f32[B, Hq]: per head, ``sum over counted pairs of (s_ij - p_ij)^2 / num_pairs(L, causal)``.
    """
    B, Hq, Hkv, Hkp, L, d, dp = check_shapes(q, k, qp, kp)
    k = jnp.repeat(k, Hq // Hkv, axis=1)  # [B, Hq, L, d]: index h holds KV head h // G
    kp = jnp.repeat(kp, Hq // Hkp, axis=1)  # [B, Hq, L, dp]
    s = jnp.einsum("bhid,bhjd->bhij", q, k, preferred_element_type=jnp.float32) * (1.0 / math.sqrt(d))
    p = jnp.einsum("bhid,bhjd->bhij", qp, kp, preferred_element_type=jnp.float32) * (1.0 / math.sqrt(dp))
    err2 = jnp.square(s - p)  # f32[B, Hq, L, L]
    if causal:
        err2 = jnp.where(jnp.tril(jnp.ones((L, L), bool)), err2, 0.0)
    return jnp.sum(err2, axis=(-2, -1)) / num_pairs(L, causal)
