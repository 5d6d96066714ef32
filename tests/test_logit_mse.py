"""TokenButler's blockwise logit-MSE loss: kernels (interpreted on CPU) against the materialised reference.

The reference itself is checked against a per-pair loop; the GPU (Triton) and TPU (Mosaic) kernels'
loss and both gradients are checked against ``jax.grad`` of the materialised reference, causal and
full, odd lengths (zero padding), GQA for k and for k'; both kernels are lowered for their real
platforms on CPU via ``jax.export`` with an abstract device.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_bounds import checked_memory
from pallas_kernels.logit_mse import logit_mse, logit_mse_reference, num_pairs
from pallas_kernels.logit_mse.gpu import logit_mse_dkp_gpu, logit_mse_fwd_gpu
from pallas_kernels.logit_mse.tpu import logit_mse_fwd_tpu

# Small tiles so that short sequences span several tiles in both directions (GPU: powers of two >= 16).
BLOCKS = {"gpu": (16, 32), "tpu": (16, 8)}


def _inputs(B, Hq, Hkv, Hkp, L, d, dp, dtype=jnp.float32, seed=0):
    ks = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(ks[0], (B, Hq, L, d), dtype)
    k = jax.random.normal(ks[1], (B, Hkv, L, d), dtype)
    qp = jax.random.normal(ks[2], (B, Hq, L, dp), dtype)
    kp = jax.random.normal(ks[3], (B, Hkp, L, dp), dtype)
    w = jax.random.uniform(ks[4], (B, Hq), jnp.float32, 0.5, 1.5)  # a non-uniform upstream cotangent
    return q, k, qp, kp, w


def _rel_err(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_reference_matches_pair_loop():
    """The spec, spelled out per pair in numpy: GQA head maps, causal pair count, the 1/sqrt(d) scales."""
    B, Hq, Hkv, Hkp, L, d, dp = 1, 4, 2, 1, 7, 6, 4
    q, k, qp, kp, _ = _inputs(B, Hq, Hkv, Hkp, L, d, dp)
    qn, kn, qpn, kpn = (np.asarray(x, np.float64) for x in (q, k, qp, kp))
    for causal in (True, False):
        want = np.zeros((B, Hq))
        for h in range(Hq):
            tot, cnt = 0.0, 0
            for i in range(L):
                for j in range(L):
                    if causal and j > i:
                        continue
                    s = qn[0, h, i] @ kn[0, h // (Hq // Hkv), j] / math.sqrt(d)
                    p = qpn[0, h, i] @ kpn[0, h // (Hq // Hkp), j] / math.sqrt(dp)
                    tot += (s - p) ** 2
                    cnt += 1
            assert cnt == num_pairs(L, causal)
            want[0, h] = tot / cnt
        got = logit_mse_reference(q, k, qp, kp, causal=causal)
        assert got.dtype == jnp.float32 and got.shape == (B, Hq)
        np.testing.assert_allclose(got, want, rtol=1e-5)
    assert not np.allclose(logit_mse_reference(q, k, qp, kp, causal=True), want)  # causal differs from full


# (B, Hq, Hkv, Hkp, L, d, dp, dtype): odd L that is not a multiple of any block; GQA on k (Hkv < Hq) and on
# k' (Hkp < Hq); d' smaller than d; bf16 inputs with f32 accumulation.
CASES = {
    "gqa_odd_f32": (2, 4, 2, 4, 45, 24, 8, jnp.float32),
    "kp_gqa_f32": (1, 4, 1, 2, 37, 16, 16, jnp.float32),
    "mha_bf16": (1, 2, 2, 2, 70, 64, 32, jnp.bfloat16),
}


@pytest.mark.parametrize("impl", ["gpu", "tpu"])
@pytest.mark.parametrize(
    "case,causal",
    [("gqa_odd_f32", True), ("gqa_odd_f32", False), ("kp_gqa_f32", True), ("mha_bf16", True), ("mha_bf16", False)],
)
def test_kernel_loss_and_grads_match_reference(impl, case, causal):
    B, Hq, Hkv, Hkp, L, d, dp, dtype = CASES[case]
    q, k, qp, kp, w = _inputs(B, Hq, Hkv, Hkp, L, d, dp, dtype)
    bq, bk = BLOCKS[impl]

    def kernel_loss(q, k, qp, kp):
        per_head = logit_mse(q, k, qp, kp, causal=causal, block_q=bq, block_k=bk, implementation=impl, interpret=True)
        return jnp.sum(per_head * w), per_head

    def reference_loss(qp, kp):  # f32 reference on the same (possibly bf16-rounded) values
        f32 = lambda x: x.astype(jnp.float32)
        return jnp.sum(logit_mse_reference(f32(q), f32(k), qp, kp, causal=causal) * w)

    (_, per_head), grads = jax.value_and_grad(kernel_loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, qp, kp)
    want_dqp, want_dkp = jax.grad(reference_loss, argnums=(0, 1))(qp.astype(jnp.float32), kp.astype(jnp.float32))
    want = logit_mse_reference(q.astype(jnp.float32), k.astype(jnp.float32), qp.astype(jnp.float32),
                               kp.astype(jnp.float32), causal=causal)

    tol = 1e-5 if dtype == jnp.float32 else 1e-2  # bf16 errors measured ~3e-3
    assert per_head.shape == (B, Hq) and per_head.dtype == jnp.float32
    np.testing.assert_allclose(per_head, want, rtol=tol)
    dq, dk, dqp, dkp = grads
    assert dqp.shape == qp.shape and dqp.dtype == qp.dtype
    assert dkp.shape == kp.shape and dkp.dtype == kp.dtype
    assert _rel_err(dqp, want_dqp) < tol, _rel_err(dqp, want_dqp)
    assert _rel_err(dkp, want_dkp) < tol, _rel_err(dkp, want_dkp)
    # The frozen model gets no gradient.
    assert dq.shape == q.shape and dk.shape == k.shape
    assert not np.any(np.asarray(dq)) and not np.any(np.asarray(dk))


@pytest.mark.parametrize("fwd,blocks", [(logit_mse_fwd_gpu, [(16, 16), (64, 16), (16, 64)]),
                                        (logit_mse_fwd_tpu, [(8, 8), (24, 16), (64, 64)])])
def test_padding_is_exact_for_any_block(fwd, blocks):
    """L = 50 is a multiple of none of the tiles; padding must add exactly nothing to the sums."""
    q, k, qp, kp, _ = _inputs(1, 2, 1, 2, 50, 16, 16)
    want_sq = logit_mse_reference(q, k, qp, kp, causal=True) * num_pairs(50, True)
    for bq, bk in blocks:
        sq, dqp = fwd(q, k, qp, kp, causal=True, block_q=bq, block_k=bk, with_dqp=True, interpret=True)
        assert dqp.shape == qp.shape
        np.testing.assert_allclose(sq, want_sq, rtol=1e-5, err_msg=f"block_q={bq} block_k={bk}")


@pytest.mark.parametrize("causal", [True, False])
def test_gpu_kernels_stay_in_their_blocks(causal):
    """Every read and write of the forward (with dq') and dk' kernels stays inside its block
    (`pallas_bounds.checked_memory`: their tile loops index the zero-padded rows with no mask, so a loop bound one
    tile too far reads past the block, which the interpreter pads and a GPU does not): L = 45 (a multiple of no
    tile, padded to 64), query tiles larger and smaller than key tiles (16 x 32, 32 x 16: the causal bounds'
    rounding), GQA on k and on k', head dims 24 and 8 padded to 32 and 16. The loss and both unscaled gradients
    against `jax.grad` of the reference (mutations: the forward's key loop, causal or full, or the dk' kernel's
    query loop one tile longer). The wrappers unjitted, so that they are traced under the check."""
    B, Hq, Hkv, Hkp, L, d, dp = 2, 4, 2, 2, 45, 24, 8
    q, k, qp, kp, _ = _inputs(B, Hq, Hkv, Hkp, L, d, dp, seed=3)
    n = num_pairs(L, causal)
    sq_err = lambda qp, kp: jnp.sum(logit_mse_reference(q, k, qp, kp, causal=causal)) * n  # noqa: E731
    want_dqp, want_dkp = (g * math.sqrt(dp) / 2 for g in jax.grad(sq_err, argnums=(0, 1))(qp, kp))
    want_sq = logit_mse_reference(q, k, qp, kp, causal=causal) * n
    for bq, bk in ((16, 32), (32, 16)):
        kw = dict(causal=causal, block_q=bq, block_k=bk, interpret=True)
        with checked_memory():
            sq, dqp = logit_mse_fwd_gpu.__wrapped__(q, k, qp, kp, with_dqp=True, **kw)
            dkp = logit_mse_dkp_gpu.__wrapped__(q, k, qp, kp, **kw)
        dkp = dkp.reshape(B, Hkp, Hq // Hkp, L, dp).sum(axis=2)  # k' head c serves query heads c * 2, c * 2 + 1
        np.testing.assert_allclose(sq, want_sq, rtol=1e-5, err_msg=f"block_q={bq} block_k={bk}")
        assert _rel_err(dqp, want_dqp) < 1e-5 and _rel_err(dkp, want_dkp) < 1e-5, (bq, bk)


def test_xla_implementation_is_the_reference_with_frozen_model():
    q, k, qp, kp, _ = _inputs(1, 2, 2, 2, 19, 8, 8)
    loss = lambda *a: jnp.sum(logit_mse(*a, causal=False, implementation="xla"))
    grads = jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, qp, kp)
    assert not np.any(np.asarray(grads[0])) and not np.any(np.asarray(grads[1]))
    want = jax.grad(lambda a, b: jnp.sum(logit_mse_reference(q, k, a, b, causal=False)), argnums=(0, 1))(qp, kp)
    np.testing.assert_allclose(grads[2], want[0], rtol=1e-6)
    np.testing.assert_allclose(grads[3], want[1], rtol=1e-6)


def test_clear_errors():
    q, k, qp, kp, _ = _inputs(1, 4, 2, 4, 20, 8, 8)
    with pytest.raises(ValueError, match="block_q=24 must be a power of two"):
        logit_mse(q, k, qp, kp, block_q=24, block_k=16, implementation="gpu", interpret=True)
    with pytest.raises(ValueError, match="block_k=12 must be a positive multiple of 8"):
        logit_mse(q, k, qp, kp, block_q=16, block_k=12, implementation="tpu", interpret=True)
    with pytest.raises(ValueError, match="implementation='cuda'"):
        logit_mse(q, k, qp, kp, implementation="cuda")
    with pytest.raises(ValueError, match="Hkv=3 must divide q's Hq=4"):
        logit_mse(q, jnp.zeros((1, 3, 20, 8)), qp, kp, implementation="xla")
    with pytest.raises(ValueError, match="sequence lengths differ"):
        logit_mse(q, k, qp[:, :, :10], kp, implementation="xla")
    with pytest.raises(ValueError, match="kp's head dim 4 must equal qp's 8"):
        logit_mse(q, k, qp, kp[..., :4], implementation="xla")
    with pytest.raises(TypeError, match="qp and kp must share a dtype"):
        logit_mse(q, k, qp, kp.astype(jnp.bfloat16), implementation="gpu", interpret=True)


def _train_step_args(B, Hq, Hkv, L, d, dp):
    bf16 = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
    return bf16(B, Hq, L, d), bf16(B, Hkv, L, d), bf16(B, Hq, L, dp), bf16(B, Hq, L, dp)


def _value_and_grad(impl, causal):
    def loss(q, k, qp, kp):
        return jnp.mean(logit_mse(q, k, qp, kp, causal=causal, implementation=impl))

    return jax.jit(jax.value_and_grad(loss, argnums=(2, 3)))


@pytest.mark.parametrize("causal", [True, False])
def test_tpu_lowering(causal):
    """Forward and backward lower to two Mosaic kernels for a real TPU (SmolLM2-like stacked heads, L not a
    multiple of the 512 default tile)."""
    from lowering import export_for

    exported = export_for("tpu", _value_and_grad("tpu", causal), *_train_step_args(1, 18, 6, 1000, 64, 32))
    assert exported.mlir_module().count("tpu_custom_call") == 2  # fwd(+dq') and dk'


def test_gpu_lowering():
    """The Triton kernels lower for an H100 without a GPU present (an abstract device names the target)."""
    from jax.experimental.pallas import triton as plgpu
    from lowering import export_for

    exported = export_for("cuda", _value_and_grad("gpu", True), *_train_step_args(1, 18, 6, 1000, 64, 32))
    text = exported.mlir_module()
    assert text.count(plgpu.CUSTOM_CALL_TARGET_NAME) == 2
    assert "logit_mse_fwd" in text and "logit_mse_dkp" in text


@pytest.mark.parametrize("causal", [True, False])
def test_kernel_loss_without_grad_matches_reference(causal):
    """The loss alone (no jax.grad: the custom_vjp's primal, as an evaluation computes it) is normalised by the pairs
    of its own `causal`, like the loss under jax.grad."""
    B, Hq, Hkv, Hkp, L, d, dp, dtype = CASES["gqa_odd_f32"]
    q, k, qp, kp, _ = _inputs(B, Hq, Hkv, Hkp, L, d, dp, dtype)
    want = logit_mse_reference(q, k, qp, kp, causal=causal)
    for impl in ("gpu", "tpu"):
        bq, bk = BLOCKS[impl]
        got = logit_mse(q, k, qp, kp, causal=causal, block_q=bq, block_k=bk, implementation=impl, interpret=True)
        np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=impl)


def test_empty_sequence_is_named():
    q, k, qp, kp, _ = _inputs(1, 2, 2, 2, 1, 8, 8)
    with pytest.raises(ValueError, match="sequence length L=0 must be >= 1"):
        logit_mse(q[:, :, :0], k[:, :, :0], qp[:, :, :0], kp[:, :, :0], implementation="xla")


def test_default_implementation_on_tpu_is_the_mosaic_kernel(monkeypatch):
    """implementation=None on a TPU backend lowers to the Mosaic kernels (fwd and dk'), not the Triton ones."""
    from lowering import export_for

    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    exported = export_for("tpu", _value_and_grad(None, True), *_train_step_args(1, 2, 1, 200, 64, 32))
    assert exported.mlir_module().count("tpu_custom_call") == 2
