"""Token Sparse Attention scoring: reference vs brute force, kernels (interpret mode) vs reference, TPU and
CUDA lowering, argument errors."""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from host_rounding import assert_same_or_close
from pallas_kernels.tsa_scoring import avg_pool_keys, gpu, reference, tpu, tsa_scores
from pallas_kernels.tsa_scoring.common import default_scale
from lowering import export_for
from pallas_bounds import checked_memory


def _inputs(B, T, Hq, Hkv, D, dtype, seed=0):
    rng = np.random.default_rng(seed)
    # Scale 2 gives peaked softmaxes (logits ~ N(0, 4)) so errors in the normaliser would show.
    q = jnp.asarray(2.0 * rng.standard_normal((B, T, Hq, D), np.float32), dtype)
    k = jnp.asarray(rng.standard_normal((B, T, Hkv, D), np.float32), dtype)
    return q, k


def _np_pool(scores, pool, lengths):
    """float64 numpy: 'same' average pooling of each row's first lengths[b] scores, zero padded, 0 past them."""
    B, H, T = scores.shape
    half = pool // 2
    out = np.zeros((B, H, T))
    for b in range(B):
        n = int(lengths[b])
        for j in range(n):
            out[b, :, j] = scores[b, :, max(0, j - half):min(n, j + half + 1)].sum(-1) / pool
    return out


def _brute_force(q, k, window, pool_kernel, lengths, scale=None):
    """float64 numpy: the full causal attention matrix of every row, its last-W rows, explicit pooling
    (`_np_pool`)."""
    q = np.asarray(jnp.asarray(q, jnp.float32), np.float64)
    k = np.asarray(jnp.asarray(k, jnp.float32), np.float64)
    B, T, Hq, D = q.shape
    G = Hq // k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    mean = np.zeros((B, Hq, T))
    for b in range(B):
        n = int(lengths[b])
        if n == 0:
            continue
        for h in range(Hq):
            logits = q[b, :n, h] @ k[b, :n, h // G].T * scale  # [n, n]
            logits = np.where(np.tril(np.ones((n, n), bool)), logits, -np.inf)
            probs = np.exp(logits - logits.max(1, keepdims=True))
            probs /= probs.sum(1, keepdims=True)
            mean[b, h, :n] = probs[max(0, n - window):].mean(0)
    return _np_pool(mean, pool_kernel, lengths)


def _rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b).max() / np.abs(b).max()


@pytest.mark.parametrize(
    "B,T,Hq,Hkv,D,window,pool_kernel,lengths",
    [
        (2, 40, 4, 2, 16, 8, 7, [40, 23]),  # GQA G=2, odd length
        (3, 33, 3, 1, 8, 16, 5, [33, 5, 0]),  # MQA, length < window, empty row
        (1, 20, 2, 2, 8, 64, 1, [17]),  # window > T, no pooling
        (1, 25, 2, 1, 8, 4, 3, None),  # lengths None
    ],
)
def test_reference_matches_brute_force(B, T, Hq, Hkv, D, window, pool_kernel, lengths):
    q, k = _inputs(B, T, Hq, Hkv, D, jnp.float32)
    lens = None if lengths is None else jnp.array(lengths, jnp.int32)
    got = reference.tsa_scores_reference(q, k, window=window, pool_kernel=pool_kernel, lengths=lens)
    want = _brute_force(q, k, window, pool_kernel, [T] * B if lengths is None else lengths)
    assert got.shape == (B, Hq, T) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def test_mean_probs_sum_to_one_and_pooling_is_torch_avg_pool1d():
    q, k = _inputs(2, 50, 2, 1, 8, jnp.float32)
    lens = jnp.array([50, 31], jnp.int32)
    mean = reference.tsa_mean_probs_reference(q, k, window=8, lengths=lens)
    np.testing.assert_allclose(np.asarray(mean.sum(-1)), 1.0, rtol=1e-5)  # each query's softmax sums to 1
    assert float(jnp.abs(mean[1, :, 31:]).max()) == 0.0
    torch = pytest.importorskip("torch")
    x = np.array(mean[:1])  # full-length row: zero padding == torch's padding
    want = torch.nn.functional.avg_pool1d(torch.from_numpy(x), 7, stride=1, padding=3).numpy()
    np.testing.assert_allclose(np.asarray(avg_pool_keys(mean[:1], 7)), want, rtol=1e-6, atol=1e-8)


# (B, T, Hq, Hkv, D, window, lengths, dtype): odd lengths, lengths < window, an empty row, T below a block,
# G = 1 / 2 / 4.
_KERNEL_CASES = [
    (3, 100, 4, 2, 32, 16, [100, 11, 0], jnp.float32),  # an empty row too
    (2, 77, 4, 1, 48, 24, [77, 60], jnp.float32),  # D not a power of two (GPU pads it), W not a block multiple
    (1, 130, 2, 2, 64, 40, [129], jnp.bfloat16),
    (2, 12, 2, 1, 16, 8, [12, 3], jnp.bfloat16),  # T shorter than every block
]


def _tolerance(dtype):
    return 1e-5 if dtype == jnp.float32 else 1e-2


@pytest.mark.parametrize("B,T,Hq,Hkv,D,window,lengths,dtype", _KERNEL_CASES)
def test_gpu_kernel_interpret_matches_reference(B, T, Hq, Hkv, D, window, lengths, dtype):
    q, k = _inputs(B, T, Hq, Hkv, D, dtype, seed=T)
    lens = jnp.array(lengths, jnp.int32)
    want = reference.tsa_scores_reference(q, k, window=window, pool_kernel=7, lengths=lens)
    bs = gpu.BlockSizes(block_q=16, block_k=16, block_k_mean=32, num_splits=3)
    got = gpu.tsa_scores_gpu(q, k, window=window, pool_kernel=7, lengths=lens, block_sizes=bs, interpret=True)
    assert got.shape == (B, Hq, T) and got.dtype == jnp.float32
    assert _rel_err(got, want) < _tolerance(dtype)
    for b, n in enumerate(lengths):
        assert float(jnp.abs(got[b, :, n:]).max(initial=0.0)) == 0.0


def test_gpu_kernels_stay_in_their_blocks():
    """Every load of the two Triton kernels stays inside its block (`pallas_bounds.checked_memory`: the interpreter
    pads stray loads, where a GPU reads another head's keys or past the row): T = 45 in key blocks of 16 and 32 (a
    partial last block of each), 3 splits, D = 8 padded to 16, G = 3, W = 20 in two query blocks of 16, a row
    shorter than the window and an empty row. The jitted pass inside is traced anew under the check."""
    q, k = _inputs(3, 45, 6, 2, 8, jnp.float32, seed=45)
    lens = jnp.array([45, 13, 0], jnp.int32)
    bs = gpu.BlockSizes(block_q=16, block_k=16, block_k_mean=32, num_splits=3)
    with checked_memory():
        got = gpu.tsa_scores_gpu(q, k, window=20, pool_kernel=7, lengths=lens, block_sizes=bs, interpret=True)
        assert _rel_err(got, reference.tsa_scores_reference(q, k, window=20, pool_kernel=7, lengths=lens)) < 1e-5


@pytest.mark.parametrize("B,T,Hq,Hkv,D,window,lengths,dtype", _KERNEL_CASES[:3])
def test_tpu_kernel_interpret_matches_reference(B, T, Hq, Hkv, D, window, lengths, dtype):
    q, k = _inputs(B, T, Hq, Hkv, D, dtype, seed=T)
    lens = jnp.array(lengths, jnp.int32)
    want = reference.tsa_mean_probs_reference(q, k, window=window, lengths=lens)
    got = tpu.tsa_mean_probs_tpu(q, k, window=window, lengths=lens, block_sizes=tpu.BlockSizes(128),
                                 interpret=True)
    assert got.shape == (B, Hq, T) and got.dtype == jnp.float32
    assert _rel_err(got, want) < _tolerance(dtype)


def test_tpu_kernel_interpret_d128_lane_layout():
    # D = 128 takes the [B, T, Hkv * D] key layout (no transpose) that the TPU path uses for real models.
    q, k = _inputs(1, 300, 4, 2, 128, jnp.float32, seed=3)
    lens = jnp.array([290], jnp.int32)
    want = reference.tsa_mean_probs_reference(q, k, window=16, lengths=lens)
    got = tpu.tsa_mean_probs_tpu(q, k, window=16, lengths=lens, block_sizes=tpu.BlockSizes(128), interpret=True)
    assert _rel_err(got, want) < 1e-5


def _walk_shapes(jaxpr, out):
    for eqn in jaxpr.eqns:
        out.extend(v.aval.shape for v in eqn.outvars if hasattr(v.aval, "shape"))
        if eqn.primitive.name == "pallas_call":
            continue  # the kernel body works on VMEM / registers, not HBM
        for p in eqn.params.values():
            for j in (p if isinstance(p, (list, tuple)) else [p]):
                if isinstance(j, jax.extend.core.ClosedJaxpr):
                    _walk_shapes(j.jaxpr, out)
                elif isinstance(j, jax.extend.core.Jaxpr):
                    _walk_shapes(j, out)
    return out


@pytest.mark.parametrize("backend", ["reference", "gpu", "tpu"])
def test_no_window_by_keys_matrix_outside_the_kernels(backend):
    B, T, Hq, Hkv, D, W = 1, 1024, 2, 1, 8, 64  # D << W: q, k and their copies stay below the bound
    q, k = _inputs(B, T, Hq, Hkv, D, jnp.float32)
    lens = jnp.array([1000], jnp.int32)
    fn = {
        "reference": lambda q, k, l: reference.tsa_mean_probs_reference(q, k, window=W, lengths=l),
        "gpu": lambda q, k, l: gpu.tsa_mean_probs_gpu(q, k, window=W, lengths=l, interpret=True),
        "tpu": lambda q, k, l: tpu.tsa_mean_probs_tpu(q, k, window=W, lengths=l, interpret=True),
    }[backend]
    shapes = _walk_shapes(jax.make_jaxpr(fn)(q, k, lens).jaxpr, [])
    biggest = max(int(np.prod(s)) for s in shapes)
    # The reference holds [B, Hq, W, T] (so the test can fail); the kernels' HBM arrays stay at [B, Hq, T]
    # scale (plus per-query statistics: [B, Hq, S, W] on GPU, a lane-replicated [B, Hq, W, 128] on TPU).
    if backend == "reference":
        assert biggest >= B * Hq * W * T
    else:
        assert biggest < B * Hq * W * T // 4, (biggest, shapes)


@pytest.mark.parametrize("T,Hq,Hkv,D,lengths", [(1000, 8, 2, 128, [1000, 517]), (640, 6, 3, 64, [333, 640])])
def test_tpu_lowering(T, Hq, Hkv, D, lengths):
    q = jax.ShapeDtypeStruct((2, T, Hq, D), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, T, Hkv, D), jnp.bfloat16)
    lens = jax.ShapeDtypeStruct((2,), jnp.int32)
    exported = jax.export.export(
        jax.jit(lambda q, k, l: tpu.tsa_scores_tpu(q, k, window=128, lengths=l)), platforms=["tpu"]
    )(q, k, lens)
    assert exported.mlir_module().count("tpu_custom_call") == 2  # the two passes, as Mosaic kernels


def test_cuda_lowering_for_h100():
    # Triton lowering needs a GPU model; an abstract H100 lets it run here (PTX compilation happens on the GPU).
    q = jax.ShapeDtypeStruct((1, 4096, 32, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 4096, 8, 128), jnp.bfloat16)
    lens = jax.ShapeDtypeStruct((1,), jnp.int32)
    exported = export_for("cuda", lambda q, k, l: gpu.tsa_scores_gpu(q, k, lengths=l), q, k, lens)
    assert exported.mlir_module().count("xla.gpu.triton") == 2


def test_api_dispatch():
    q, k = _inputs(1, 30, 2, 1, 8, jnp.float32)
    lens = jnp.array([21], jnp.int32)
    want = reference.tsa_scores_reference(q, k, window=8, pool_kernel=3, lengths=lens)
    got = tsa_scores(q, k, window=8, pool_kernel=3, lengths=lens)  # cpu -> "xla", the reference's ops
    assert_same_or_close(got, want, rtol=1e-5, atol=1e-7)
    got = jax.jit(lambda q, k, l: tsa_scores(q, k, window=8, pool_kernel=3, lengths=l, implementation="xla"))(
        q, k, lens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)


@pytest.mark.parametrize("kwargs,match", [
    (dict(window=0), r"window \(W\) must be a positive int.*got 0"),
    (dict(window=-3), r"window \(W\) must be a positive int.*got -3"),
    (dict(window=2.5), r"window \(W\) must be a positive int.*got 2.5"),
    (dict(window=True), r"window \(W\) must be a positive int.*got True"),
    (dict(pool_kernel=0), r"pool_kernel must be a positive odd int.*got 0"),
    (dict(pool_kernel=4), r"pool_kernel must be odd.*got 4"),
    (dict(pool_kernel=7.0), r"pool_kernel must be a positive odd int.*got 7.0"),
    (dict(lengths=jnp.array([9, 3])), r"lengths must lie in \[0, T=8\], got values in \[3, 9\]"),
    (dict(lengths=jnp.array([-1, 3])), r"lengths must lie in \[0, T=8\], got values in \[-1, 3\]"),
    (dict(lengths=jnp.array([3])), r"lengths must be i32\[B=2\]"),
    (dict(lengths=jnp.array([3.0, 2.0])), r"lengths must be an integer array"),
    (dict(implementation="cuda"), r"implementation must be one of .*got 'cuda'"),
    (dict(scale=-1.0), r"scale must be a positive finite float, got -1.0"),
])
def test_argument_errors(kwargs, match):
    q, k = _inputs(2, 8, 4, 2, 8, jnp.float32)
    with pytest.raises(ValueError, match=match):
        tsa_scores(q, k, **kwargs)


def test_shape_errors():
    q, k = _inputs(2, 8, 4, 2, 8, jnp.float32)
    with pytest.raises(ValueError, match=r"Hq=4 must be a multiple of KV heads Hkv=3"):
        tsa_scores(q, jnp.zeros((2, 8, 3, 8)))
    with pytest.raises(ValueError, match=r"k must be \[B=2, T=8, Hkv, D=8\]"):
        tsa_scores(q, k[:, :5])
    with pytest.raises(ValueError, match=r"share one floating dtype"):
        tsa_scores(q, k.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match=r"window \(W\) must be a positive int"):
        gpu.tsa_scores_gpu(q, k, window=0)
    with pytest.raises(ValueError, match=r"pool_kernel must be odd"):
        tpu.tsa_scores_tpu(q, k, pool_kernel=2)
    with pytest.raises(ValueError, match=r"block_k must be a positive multiple of 128, got 100"):
        tpu.BlockSizes(100)
    with pytest.raises(ValueError, match=r"block_q must be a power of two >= 16, got 24"):
        gpu.BlockSizes(block_q=24)
    assert default_scale(64, None) == 0.125


@pytest.mark.parametrize("pool", [3, 7])
def test_avg_pool_keys_pads_with_zeros_past_lengths(pool):
    """avg_pool_keys treats the keys at or past `lengths` as zero padding going in, not only zeroes them coming out.
    tsa_scores' own call cannot show it (its mean probabilities are already 0 past each row's length), but the
    official TSA prefix-only pooling that tsa_scores' docstring gives, `avg_pool_keys(mean, pool_kernel,
    lengths - window)`, pools scores that are nonzero past that bound (the window's keys): the last pool_kernel // 2
    prefix keys must not average them in. Compared with a float64 numpy pooling of each row's prefix alone."""
    rng = np.random.default_rng(5)
    B, H, T = 3, 2, 20
    scores = rng.uniform(0.1, 1.0, (B, H, T)).astype(np.float32)  # nonzero everywhere, past the lengths too
    lengths = np.array([12, 1, 20], np.int32)  # a prefix, a one-key row, a full row
    got = avg_pool_keys(scores, pool, lengths)
    np.testing.assert_allclose(np.asarray(got, np.float64), _np_pool(scores.astype(np.float64), pool, lengths),
                               rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("scale", [0.03, 1.0])
def test_xla_path_uses_the_given_scale(scale):
    """tsa_scores' CPU default honours a custom softmax scale (no library caller passes one, so a path falling back
    to 1/sqrt(D) had passed every other test; a mutation audit's survivor)."""
    q, k = _inputs(2, 30, 4, 2, 16, jnp.float32, seed=3)
    lengths = np.array([30, 17], np.int32)
    got = tsa_scores(q, k, window=8, pool_kernel=3, lengths=lengths, scale=scale, implementation="xla")
    np.testing.assert_allclose(np.asarray(got, np.float64), _brute_force(q, k, 8, 3, lengths, scale=scale),
                               rtol=1e-4, atol=1e-6)
