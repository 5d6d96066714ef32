"""EvoSparse's one-launch block selection (`block_scores.select_blocks`, Pallas Triton in interpret mode) equals
its XLA specification on random rows: heat with many ties (zeros and rounded values), retrieval sets with -1
padding, rows whose budget covers every block, rows with fewer middle blocks than the heat count, no heat and
no retrieval set; and the method's selection is the same through either implementation."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.block_scores import gpu, xla
from pallas_kernels.block_scores.api import select_blocks


def _case(rng, B, Hkv, nb, width, wr, ties):
    nbv = rng.integers(1, nb + 1, B)
    n_s = np.minimum(rng.integers(0, 4, B), nbv)
    n_l = np.minimum(rng.integers(0, 6, B), nbv - n_s)
    hi = nbv - n_l
    ret = np.full((B, wr), -1, np.int32)
    for b in range(B):
        mid = np.arange(n_s[b], hi[b])
        take = rng.permutation(mid)[: rng.integers(0, min(wr, len(mid)) + 1)]
        ret[b, : len(take)] = np.sort(take)
    if ties:  # one more entry anywhere (sink, local, past the visible blocks too): outside the middle it is none
        for b in range(B):
            valid = ret[b][ret[b] >= 0]
            if len(valid) < wr:
                extra = rng.choice(np.setdiff1d(np.arange(nb), valid))
                ret[b, : len(valid) + 1] = np.sort(np.append(valid, extra))
    heat = rng.random((B, Hkv, nb)).astype(np.float32)
    if ties:
        heat = np.round(heat * 4) / 4  # many equal values, zeros among them
    count = rng.integers(0, width, B)
    full = rng.random(B) < 0.2
    return [jnp.asarray(x) for x in (heat, ret, n_s, hi, nbv, count)] + [jnp.asarray(full)]


@pytest.mark.parametrize("nb,width,wr,ties,seed", [(37, 12, 3, True, 0), (100, 30, 5, False, 1),
                                                   (64, 64, 1, True, 2), (300, 41, 8, True, 3)])
@pytest.mark.parametrize("parts", ["both", "no_heat", "no_ret"])
def test_select_blocks_kernel_matches_xla(nb, width, wr, ties, seed, parts):
    rng = np.random.default_rng(seed)
    B, Hkv = 5, 3
    heat, ret, n_s, hi, nbv, count, full = _case(rng, B, Hkv, nb, width, wr, ties)
    heat = None if parts == "no_heat" else heat
    ret = None if parts == "no_ret" else ret
    kw = dict(num_kv_heads=Hkv, nb=nb, width=width, heat_width=max(1, width // 2))
    want = np.asarray(xla.select_blocks_xla(heat, ret, n_s, hi, nbv, count, full, **kw))
    got = np.asarray(gpu.select_blocks_gpu(heat, ret, n_s, hi, nbv, count, full, interpret=True, **kw))
    np.testing.assert_array_equal(got, want)
    # well formed: ascending, then -1; the sink and local ranges are in every row that is not full
    for b in range(B):
        for h in range(Hkv):
            row = want[b, h]
            v = row[row >= 0]
            assert np.all(np.diff(v) > 0) and np.all(row[len(v):] == -1)


def test_select_blocks_dispatch_and_errors():
    rng = np.random.default_rng(4)
    heat, ret, n_s, hi, nbv, count, full = _case(rng, 2, 2, 50, 10, 2, True)
    kw = dict(num_kv_heads=2, nb=50, width=10, heat_width=5)
    want = xla.select_blocks_xla(heat, ret, n_s, hi, nbv, count, full, **kw)
    np.testing.assert_array_equal(np.asarray(select_blocks(heat, ret, n_s, hi, nbv, count, full, **kw)),
                                  np.asarray(want))  # CPU: XLA
    with pytest.raises(ValueError, match="implementation='triton'"):
        select_blocks(heat, ret, n_s, hi, nbv, count, full, implementation="triton", **kw)
    with pytest.raises(ValueError, match="nb=40000"):
        gpu.select_blocks_gpu(None, ret, n_s, hi, nbv, count, full, num_kv_heads=2, nb=40000, width=10,
                              heat_width=5, interpret=True)
    with pytest.raises(ValueError, match="heat of shape"):
        gpu.select_blocks_gpu(heat[:, :1], ret, n_s, hi, nbv, count, full, interpret=True, **kw)


def test_method_selection_same_through_the_kernel(monkeypatch):
    from jsparse.methods.evosparse import EvoSparse
    real = gpu.select_blocks_gpu
    monkeypatch.setattr(gpu, "select_blocks_gpu", lambda *a, **k: real(*a, interpret=True, **k))
    rng = np.random.default_rng(5)
    B, Hkv, N = 3, 2, 512
    pos = jnp.asarray([100, 300, 511], jnp.int32)
    for budget in (128, 600):  # 600: the last row's budget covers every block
        m = EvoSparse(budget_tokens=budget, block_size=8)
        heat = jnp.asarray(np.round(rng.random((B, Hkv, N // 8)) * 8) / 8, jnp.float32)
        ret = jnp.full((B, max(m.widths(N)["retrieval"], 1)), -1, jnp.int32).at[:, 0].set(jnp.asarray([5, 7, 9]))
        for r in (ret, None):
            want = m.replace(kernels="xla").select_blocks(heat, r, pos, Hkv, N)
            got = m.replace(kernels="pallas_gpu").select_blocks(heat, r, pos, Hkv, N)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_heat_update_kernel_matches_xla():
    """The in-place heat kernel (interpret mode) = decay * row + the mass scattered into its blocks, on the chosen
    layer only (negative layer wraps), for rows with -1 padding, a full row and an empty row."""
    from pallas_kernels.block_scores.api import heat_update_layer
    rng = np.random.default_rng(6)
    L, B, Hkv, nb, K = 3, 2, 3, 70, 12
    heat = jnp.asarray(rng.random((L, B, Hkv, nb)), jnp.float32)
    idx = np.full((B, Hkv, K), -1, np.int32)
    for b in range(B):
        for h in range(Hkv):
            n = [K, 0, 5][h]
            idx[b, h, :n] = np.sort(rng.choice(nb, n, replace=False))
    mass = jnp.asarray(rng.random((B, Hkv, K)), jnp.float32)
    idx = jnp.asarray(idx)
    for layer in (1, -1):
        want = heat_update_layer(heat, jnp.int32(layer), idx, mass, 0.75, implementation="xla")
        got = gpu.heat_update_gpu(heat, jnp.int32(layer), idx, mass, 0.75, interpret=True)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7)
        lay = layer % L
        manual = np.asarray(heat).copy()
        manual[lay] *= 0.75
        for b in range(B):
            for h in range(Hkv):
                for e, m in zip(np.asarray(idx[b, h]), np.asarray(mass[b, h])):
                    if e >= 0:
                        manual[lay, b, h, e] += m
        np.testing.assert_allclose(np.asarray(got), manual, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="expected \\[B=2, Hkv=3, K\\] both"):
        gpu.heat_update_gpu(heat, jnp.int32(0), idx[:, :2], mass, 0.5, interpret=True)


def test_method_heat_through_the_kernel(monkeypatch):
    """A decode step of the EvoSparse layer with the GPU kernels (selection and in-place heat, interpret mode) =
    the same step through XLA (outputs and state); the attention itself runs through XLA in both."""
    from jsparse.methods.evosparse import EvoSparse, EvoState
    from models.attention import LayerContext, LayerKV
    for name in ("heat_update_gpu", "select_blocks_gpu"):
        real = getattr(gpu, name)
        monkeypatch.setattr(gpu, name, lambda *a, real=real, **k: real(*a, interpret=True, **k))
    xla_attend = EvoSparse.attend
    monkeypatch.setattr(EvoSparse, "attend", lambda self, *a, **k: xla_attend(self.replace(kernels="xla"), *a, **k))
    rng = np.random.default_rng(8)
    L, B, Hq, Hkv, D, N = 3, 2, 4, 2, 16, 256
    k_all = jnp.asarray(rng.standard_normal((L, B, Hkv, N, D)), jnp.float32)
    v_all = jnp.asarray(rng.standard_normal((L, B, Hkv, N, D)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((B, 1, Hq, D)), jnp.float32)
    lengths = jnp.asarray([200, 256], jnp.int32)
    m = EvoSparse(budget_tokens=64, block_size=8, sink_fraction=0.125, local_fraction=0.375, retrieval_fraction=0.0,
                  heat_fraction=0.5)
    heat = jnp.asarray(rng.random((L, B, Hkv, N // 8)), jnp.float32)
    cache = LayerKV(k=k_all[1], v=v_all[1], k_all=k_all, v_all=v_all, layer=jnp.int32(1))
    ctx = LayerContext(layer=jnp.int32(1), lengths=lengths, segment="sparse")
    (o1, s1), (o2, s2) = (m.replace(kernels=kn).decode(ctx, q, cache, EvoState(heat=heat))
                          for kn in ("xla", "pallas_gpu"))
    np.testing.assert_allclose(np.asarray(o2), np.asarray(o1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(s2.heat), np.asarray(s1.heat), rtol=1e-5, atol=1e-6)
    assert float(jnp.max(jnp.abs(s1.heat[1] - heat[1]))) > 0 and bool(jnp.all(s1.heat[0] == heat[0]))
