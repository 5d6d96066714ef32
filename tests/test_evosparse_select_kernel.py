"""EvoSparse's one-launch block selection (`block_scores.select_blocks`, Pallas Triton in interpret mode) equals
its XLA specification on random rows: heat with many ties (zeros and rounded values), retrieval sets with -1
padding, rows whose budget covers every block, rows with fewer middle blocks than the heat count, no heat and
no retrieval set; and the method's selection is the same through either implementation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.block_scores import gpu, xla
from pallas_kernels.block_scores.api import select_blocks
from pallas_bounds import checked_memory


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


def _least_k(count, ret, n_s, hi, heat_width):
    """The fewest heat candidates a row's selection can be made from: its heat part (count, at most heat_width)
    and the retrieval blocks in its middle [n_s, hi) (which `select_from_candidates` skips among them)."""
    n_ret_mid = 0 if ret is None else jnp.sum((ret >= n_s[:, None]) & (ret < hi[:, None]), axis=-1)
    return jnp.minimum(count, heat_width) + n_ret_mid


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
    np.testing.assert_array_equal(want, _np_select(heat, ret, n_s, hi, nbv, count, full, Hkv, width,
                                                   max(1, width // 2)))


def _np_select(heat, ret, n_s, hi, nbv, count, full, Hkv, width, heat_width):
    """numpy, one row at a time: every visible block on a full row; else the sink [0, n_s), the retrieval blocks in
    the middle [n_s, hi), the min(count, heat_width) hottest other middle blocks (ties to the lower block) and the
    local [hi, nbv); ascending, cut at `width`, then -1."""
    B = len(n_s)
    out = np.full((B, Hkv, width), -1, np.int32)
    for b, h in np.ndindex(B, Hkv):
        s_, hi_, nv = int(n_s[b]), int(hi[b]), int(nbv[b])
        if full[b]:
            blocks = set(range(nv))
        else:
            r = set() if ret is None else {int(x) for x in np.asarray(ret[b]) if s_ <= x < hi_}
            blocks = set(range(s_)) | r | set(range(hi_, nv))
            if heat is not None:
                rest = [x for x in range(s_, hi_) if x not in r]
                hot = sorted(rest, key=lambda x: (-float(heat[b, h, x]), x))
                blocks |= set(hot[:min(int(count[b]), heat_width)])
        row = sorted(blocks)[:width]
        out[b, h, :len(row)] = row
    return out


@pytest.mark.parametrize("layer", [2, -1, 0])
def test_select_blocks_reads_the_stacked_heat_in_place(layer):
    """With `layer`, both implementations take the stacked heat [L, B, Hkv, nb] and use row `layer` (negative
    indices wrap): the same blocks as the row handed over alone."""
    rng = np.random.default_rng(7)
    B, Hkv, nb, width, L = 3, 2, 50, 16, 4
    heat, ret, n_s, hi, nbv, count, full = _case(rng, B, Hkv, nb, width, 4, False)
    stacked = jnp.asarray(rng.random((L, B, Hkv, nb)).astype(np.float32)).at[layer].set(heat)
    kw = dict(num_kv_heads=Hkv, nb=nb, width=width, heat_width=width // 2)
    want = np.asarray(xla.select_blocks_xla(heat, ret, n_s, hi, nbv, count, full, **kw))
    args = (stacked, ret, n_s, hi, nbv, count, full)
    np.testing.assert_array_equal(xla.select_blocks_xla(*args, layer=jnp.int32(layer), **kw), want)
    np.testing.assert_array_equal(gpu.select_blocks_gpu(*args, layer=jnp.int32(layer), interpret=True, **kw), want)
    with pytest.raises(ValueError, match="expected"):
        gpu.select_blocks_gpu(stacked[:, :, :1], *args[1:], layer=jnp.int32(0), interpret=True, **kw)


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


@pytest.mark.parametrize("nb,width,wr,ties,seed", [(37, 12, 3, True, 0), (100, 30, 5, False, 1),
                                                   (300, 41, 8, True, 3), (64, 64, 1, False, 4)])
@pytest.mark.parametrize("has_ret", [True, False])
def test_selection_from_heat_candidates_equals_select_blocks(nb, width, wr, ties, seed, has_ret):
    """The two-part selection (the k hottest middle blocks per row, then ranks over those candidates outside
    the retrieval set) equals `select_blocks_xla` whenever k >= count + the retrieval blocks in the middle, for
    the XLA version and the Triton kernel (interpret mode), stacked with a layer index too."""
    from pallas_kernels.block_scores.xla import heat_candidates, select_from_candidates_xla
    rng = np.random.default_rng(seed)
    B, Hkv = 5, 3
    heat, ret, n_s, hi, nbv, count, full = _case(rng, B, Hkv, nb, width, wr, ties)
    ret = ret if has_ret else None
    hw = max(1, width // 2)
    kw = dict(num_kv_heads=Hkv, width=width, heat_width=hw)
    want = np.asarray(xla.select_blocks_xla(heat, ret, n_s, hi, nbv, count, full, nb=nb, **kw))
    for extra in (0, 3):  # the least k that works, and more
        k = _least_k(count, ret, n_s, hi, hw) + extra
        cand = heat_candidates(heat, n_s, hi, k, width=hw + wr + 3)
        got = select_from_candidates_xla(heat, cand, ret, n_s, hi, nbv, count, full, **kw)
        np.testing.assert_array_equal(got, want)
        got = gpu.select_from_candidates_gpu(heat, cand, ret, n_s, hi, nbv, count, full, interpret=True, **kw)
        np.testing.assert_array_equal(got, want)
    stacked_h = jnp.stack([heat * 0.5, heat, heat * 2.0])  # row 1 (= -2) is the layer's
    stacked_c = jnp.stack([cand[..., ::-1], cand, cand[..., ::-1]])
    for layer in (1, -2):
        got = gpu.select_from_candidates_gpu(stacked_h, stacked_c, ret, n_s, hi, nbv, count, full,
                                             layer=jnp.int32(layer), interpret=True, **kw)
        np.testing.assert_array_equal(got, want)
        got = select_from_candidates_xla(stacked_h, stacked_c, ret, n_s, hi, nbv, count, full,
                                         layer=jnp.int32(layer), **kw)
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("has_ret", [True, False])
def test_selection_from_a_plan_subtracts_the_retrieval_set_in_kernel(has_ret):
    """`select_from_plan` (the five row arrays as one plan, `gpu.make_plan`, made once per step) with count_less_ret:
    `count` is given before the retrieval set, whose valid entries (ret >= 0, wherever they lie) the kernel subtracts
    itself; the same blocks as `select_from_candidates_xla` given the subtracted count, for the Triton kernel
    (interpret mode, stacked with a layer index) and the dispatch's XLA path (the plan unpacked)."""
    from pallas_kernels.block_scores.api import select_from_plan
    from pallas_kernels.block_scores.xla import heat_candidates, select_from_candidates_xla
    rng = np.random.default_rng(11)
    B, Hkv, nb, width, wr = 5, 3, 100, 30, 5
    heat, ret, n_s, hi, nbv, count, full = _case(rng, B, Hkv, nb, width, wr, True)
    # A gap in row 0, an empty set in row 2, and in a row whose heat count bites an entry past the middle: it counts
    # too (`ret >= 0`).
    hw = width // 2
    b = next(b for b in (1, 3, 4) if not full[b] and 1 <= count[b] <= hw and hi[b] - n_s[b] > count[b] + wr)
    ret = ret.at[0, 1].set(-1).at[2].set(-1).at[b, wr - 1].set(hi[b]) if has_ret else None
    kw = dict(num_kv_heads=Hkv, width=width, heat_width=hw)
    valid = np.zeros(B, np.int32) if ret is None else np.sum(np.asarray(ret) >= 0, axis=-1)
    before = count + valid  # the count before the retrieval set, as the plan holds it
    assert (np.asarray(before) > np.asarray(count)).any() == has_ret
    k = _least_k(count, ret, n_s, hi, hw) + 2
    cand = heat_candidates(heat, n_s, hi, k, width=hw + wr + 3)
    want = np.asarray(select_from_candidates_xla(heat, cand, ret, n_s, hi, nbv, count, full, **kw))
    if has_ret:  # the entry past the middle changes the count: a subtraction of the middle's entries alone differs
        mid = np.sum((np.asarray(ret) >= np.asarray(n_s)[:, None]) & (np.asarray(ret) < np.asarray(hi)[:, None]), -1)
        other = select_from_candidates_xla(heat, cand, ret, n_s, hi, nbv, before - mid, full, **kw)
        assert not np.array_equal(np.asarray(other), want)
    plan = gpu.make_plan(n_s, hi, nbv, before, full)
    assert plan.shape == (B, gpu.PLAN) and not np.asarray(plan[:, 5:]).any()
    stacked_h, stacked_c = jnp.stack([heat * 2.0, heat]), jnp.stack([cand[..., ::-1], cand])
    got = gpu.select_from_plan_gpu(stacked_h, stacked_c, ret, plan, layer=jnp.int32(1), count_less_ret=True,
                                   interpret=True, **kw)
    np.testing.assert_array_equal(got, want)
    got = select_from_plan(heat, cand, ret, plan, count_less_ret=True, implementation="xla", **kw)
    np.testing.assert_array_equal(got, want)
    if has_ret:  # without the subtraction the heat takes more blocks: the flag matters
        more = gpu.select_from_plan_gpu(heat, cand, ret, plan, interpret=True, **kw)
        assert not np.array_equal(np.asarray(more), want)
    with pytest.raises(ValueError, match=r"plan of shape \(5, 5\): expected \[B, 8\]"):
        gpu.select_from_plan_gpu(heat, cand, ret, plan[:, :5], interpret=True, **kw)


def test_select_kernels_stay_in_their_blocks():
    """Every load and store of the selection kernels stays inside its block (`pallas_bounds.checked_memory`:
    the interpreter pads stray loads and drops stray stores, where a GPU reads or overwrites another program's
    rows): 37 blocks in a row of 64 lanes, a width of 12 in 32 lanes, 3 retrieval slots searched in 4, heat and
    candidates read at a layer of the stack, candidates padded with -1 and past the middle."""
    from pallas_kernels.block_scores.xla import heat_candidates
    rng = np.random.default_rng(6)
    B, Hkv, nb, width, wr = 5, 3, 37, 12, 3
    heat, ret, n_s, hi, nbv, count, full = _case(rng, B, Hkv, nb, width, wr, True)
    kw = dict(num_kv_heads=Hkv, width=width, heat_width=width // 2)
    want = np.asarray(xla.select_blocks_xla(heat, ret, n_s, hi, nbv, count, full, nb=nb, **kw))
    cand = heat_candidates(heat, n_s, hi, jnp.minimum(count, width // 2) + wr, width=width // 2 + wr + 3)
    stacked_h, stacked_c = jnp.stack([heat * 2.0, heat]), jnp.stack([cand[..., ::-1], cand])
    with checked_memory():
        got = gpu.select_blocks_gpu(stacked_h, ret, n_s, hi, nbv, count, full, nb=nb, layer=jnp.int32(1),
                                    interpret=True, **kw)
        np.testing.assert_array_equal(got, want)
        got = gpu.select_from_candidates_gpu(stacked_h, stacked_c, ret, n_s, hi, nbv, count, full,
                                             layer=jnp.int32(-1), interpret=True, **kw)
        np.testing.assert_array_equal(got, want)
        # Both layers at once into a stack of their rows, the last one included (a grid of 4 for the 2).
        out = jnp.full((2, B, Hkv, width), -7, jnp.int32)
        got = gpu.select_span_gpu(stacked_h, stacked_c, ret, gpu.make_plan(n_s, hi, nbv, count, full), out,
                                  jnp.int32(0), jnp.int32(2), span=4, heat_width=width // 2, interpret=True)
        np.testing.assert_array_equal(got[1], want)


def test_select_from_candidates_limits():
    """The rank kernel refuses rows wider than CAND_LIMIT; the dispatch then picks XLA (its lowering for CUDA is
    in tests/test_block_scores.py)."""
    from pallas_kernels.block_scores.api import select_from_candidates
    B, Hkv, nb = 2, 2, 600
    z = jnp.zeros((B,), jnp.int32)
    wide = jnp.zeros((B, Hkv, gpu.CAND_LIMIT + 1), jnp.int32)
    with pytest.raises(ValueError, match="CAND_LIMIT"):
        gpu.select_from_candidates_gpu(jnp.zeros((B, Hkv, nb)), wide, None, z, z, z, z, z.astype(bool),
                                       num_kv_heads=Hkv, width=8, heat_width=4, interpret=True)
    got = select_from_candidates(jnp.zeros((B, Hkv, nb)), wide - 1, None, z, z + 5, z + 9, z, z.astype(bool),
                                 num_kv_heads=Hkv, width=8, heat_width=4)  # dispatch: XLA
    np.testing.assert_array_equal(got[0, 0], [5, 6, 7, 8, -1, -1, -1, -1])  # no sink, no candidate: local 5-8


def _edge_rows():
    """Two rows (2 KV heads, 40 blocks, width 24) whose retrieval sets touch the middle's ends: row 0 has no sink
    and block 0 in its set (a valid entry of value 0), row 1 has its first middle block n_s = 3 and its last
    hi - 1 = 29 in its set, and a block of its sink (1) and of its local range (33) that count as none. Heat in
    quarter steps (ties, zeros)."""
    rng = np.random.default_rng(11)
    n_s, hi, nbv = np.array([0, 3]), np.array([30, 30]), np.array([36, 40])
    ret = np.array([[0, 7, 12, 20, -1], [1, 3, 9, 29, 33]], np.int32)
    heat = np.round(rng.random((2, 2, 40)) * 4).astype(np.float32) / 4
    count, full = np.array([5, 4]), np.array([False, False])
    return [jnp.asarray(x) for x in (heat, ret, n_s, hi, nbv, count, full)]


def test_select_kernels_take_retrieval_blocks_at_the_middles_ends():
    """A retrieval block 0 (the binary search's count of valid entries must take it) and retrieval blocks at n_s
    and hi - 1: both kernels select them whatever their heat, as the XLA specification and the numpy model,
    with and without heat."""
    from pallas_kernels.block_scores.xla import heat_candidates, select_from_candidates_xla
    heat, ret, n_s, hi, nbv, count, full = _edge_rows()
    kw = dict(num_kv_heads=2, width=24, heat_width=6)
    for h in (heat, None):
        want = np.asarray(xla.select_blocks_xla(h, ret, n_s, hi, nbv, count, full, nb=40, **kw))
        np.testing.assert_array_equal(want, _np_select(h, ret, n_s, hi, nbv, count, full, 2, 24, 6))
        got = gpu.select_blocks_gpu(h, ret, n_s, hi, nbv, count, full, nb=40, interpret=True, **kw)
        np.testing.assert_array_equal(got, want)
    for b, blocks in ((0, [0, 7, 12, 20]), (1, [3, 9, 29])):
        assert all(x in want[b, 0] for x in blocks)
    k = _least_k(count, ret, n_s, hi, 6)
    cand = heat_candidates(heat, n_s, hi, k, width=12)
    want = np.asarray(xla.select_blocks_xla(heat, ret, n_s, hi, nbv, count, full, nb=40, **kw))
    np.testing.assert_array_equal(select_from_candidates_xla(heat, cand, ret, n_s, hi, nbv, count, full, **kw), want)
    got = gpu.select_from_candidates_gpu(heat, cand, ret, n_s, hi, nbv, count, full, interpret=True, **kw)
    np.testing.assert_array_equal(got, want)


def test_select_from_candidates_kernel_drops_candidates_outside_the_middle():
    """Candidates that are not middle blocks (hi itself, a local block, a sink block, hot ones: heat 9) are none,
    in the kernel as in its XLA specification: the blocks are `select_blocks`'."""
    from pallas_kernels.block_scores.xla import heat_candidates, select_from_candidates_xla
    heat, ret, n_s, hi, nbv, count, full = _edge_rows()
    kw = dict(num_kv_heads=2, width=24, heat_width=6)
    want = np.asarray(xla.select_blocks_xla(heat, ret, n_s, hi, nbv, count, full, nb=40, **kw))
    stray = jnp.array([[30, 31, 39], [30, 35, 2]], jnp.int32)  # hi, local, past nbv; row 1: hi, local, sink
    hot = heat.at[jnp.arange(2)[:, None], :, stray].set(9.0)  # the middle's heat unchanged
    np.testing.assert_array_equal(xla.select_blocks_xla(hot, ret, n_s, hi, nbv, count, full, nb=40, **kw), want)
    k = _least_k(count, ret, n_s, hi, 6)
    cand = jnp.concatenate([jnp.broadcast_to(stray[:, None], (2, 2, 3)), heat_candidates(hot, n_s, hi, k, width=12)],
                           axis=-1)
    np.testing.assert_array_equal(select_from_candidates_xla(hot, cand, ret, n_s, hi, nbv, count, full, **kw), want)
    got = gpu.select_from_candidates_gpu(hot, cand, ret, n_s, hi, nbv, count, full, interpret=True, **kw)
    np.testing.assert_array_equal(got, want)


def _interpreted(monkeypatch, calls):
    """Runs the two select kernels interpreted wherever `gpu` is called (the dispatcher too), counting calls."""
    for name in ("select_blocks_gpu", "select_from_candidates_gpu"):
        def run(*a, _f=getattr(gpu, name), _name=name, **kw):
            calls.append(_name)
            return _f(*a, interpret=True, **kw)
        monkeypatch.setattr(gpu, name, run)


@pytest.mark.parametrize("layer", [0, 1, -1])
def test_select_kernels_read_the_layers_own_candidates_and_heat(monkeypatch, layer):
    """Stacked heat and candidates whose layers differ (independent heat, each layer's own candidates): row
    `layer` of both is used, by the kernels and by the dispatcher's Triton path with `layer`, equal to the call on
    that layer's rows alone."""
    from pallas_kernels.block_scores.api import select_from_candidates
    from pallas_kernels.block_scores.xla import heat_candidates
    calls = []
    _interpreted(monkeypatch, calls)
    rng = np.random.default_rng(12)
    B, Hkv, nb, width, hw = 4, 2, 50, 16, 8
    _, ret, n_s, hi, nbv, count, full = _case(rng, B, Hkv, nb, width, 4, False)
    heat = jnp.asarray(rng.random((3, B, Hkv, nb)).astype(np.float32))
    k = _least_k(count, ret, n_s, hi, hw)
    cand = heat_candidates(heat, n_s, hi, k, width=hw + 4)  # [3, B, Hkv, Wc]
    kw = dict(num_kv_heads=Hkv, width=width, heat_width=hw)
    rows = (ret, n_s, hi, nbv, count, full)
    want = np.asarray(xla.select_blocks_xla(heat[layer], *rows, nb=nb, **kw))
    lay = jnp.int32(layer)
    np.testing.assert_array_equal(gpu.select_from_candidates_gpu(heat, cand, *rows, layer=lay, **kw), want)
    np.testing.assert_array_equal(select_from_candidates(heat, cand, *rows, layer=lay, implementation="pallas_gpu",
                                                         **kw), want)
    np.testing.assert_array_equal(select_blocks(heat, *rows, nb=nb, layer=lay, implementation="pallas_gpu", **kw),
                                  want)
    assert calls == ["select_from_candidates_gpu"] * 2 + ["select_blocks_gpu"]


def test_select_from_candidates_dispatch_on_a_gpu(monkeypatch):
    """implementation=None on a GPU: the rank kernel for candidates and a retrieval set at most CAND_LIMIT wide;
    XLA when the retrieval set alone is wider (the kernel would refuse it), with the same blocks."""
    from pallas_kernels.block_scores.api import select_from_candidates
    calls = []
    _interpreted(monkeypatch, calls)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    heat, ret, n_s, hi, nbv, count, full = _edge_rows()
    kw = dict(num_kv_heads=2, width=24, heat_width=6)
    cand = jnp.broadcast_to(jnp.arange(3, 15, dtype=jnp.int32), (2, 2, 12))
    want = np.asarray(xla.select_from_candidates_xla(heat, cand, ret, n_s, hi, nbv, count, full, **kw))
    np.testing.assert_array_equal(select_from_candidates(heat, cand, ret, n_s, hi, nbv, count, full, **kw), want)
    assert calls == ["select_from_candidates_gpu"]
    wide = jnp.concatenate([ret, jnp.full((2, gpu.CAND_LIMIT + 1 - ret.shape[1]), -1, jnp.int32)], axis=1)
    np.testing.assert_array_equal(select_from_candidates(heat, cand, wide, n_s, hi, nbv, count, full, **kw), want)
    assert calls == ["select_from_candidates_gpu"]


@pytest.mark.parametrize("first,count", [(1, 3), (0, 4), (2, 0), (3, 1)])
@pytest.mark.parametrize("has_ret", [True, False])
def test_span_selects_several_layers_at_once(first, count, has_ret):
    """`select_span` (several layers' selections in one launch, into their rows of a stacked output) writes rows
    first .. first + count - 1 exactly as `select_from_plan` selects each layer (its own heat and candidates, the
    shared set and plan) and keeps every other row: the Triton kernel (interpret mode, grid wider than count) and
    the XLA path alike."""
    from pallas_kernels.block_scores.api import select_from_plan, select_span
    from pallas_kernels.block_scores.xla import heat_candidates
    rng = np.random.default_rng(17 + first + 5 * count)
    B, Hkv, nb, width, wr, L = 3, 2, 90, 24, 4, 5
    heat, ret, n_s, hi, nbv, count_r, full = _case(rng, B, Hkv, nb, width, wr, True)
    ret = ret if has_ret else None
    hw = width // 2
    k = _least_k(count_r, ret, n_s, hi, hw) + 2
    plan = gpu.make_plan(n_s, hi, nbv, count_r + (0 if ret is None else jnp.sum(ret >= 0, axis=-1)), full)
    heats = jnp.stack([heat * (1.0 + 0.5 * layer) + jnp.asarray(rng.random(heat.shape), jnp.float32)
                       for layer in range(L)])  # every layer its own order
    cands = heat_candidates(heats, n_s, hi, k, width=hw + wr + 3)
    kw = dict(heat_width=hw, count_less_ret=True)
    out = jnp.asarray(rng.integers(-1, nb, (L, B, Hkv, width)), jnp.int32)
    want = np.array(out)
    for layer in range(first, first + count):
        want[layer] = select_from_plan(heats, cands, ret, plan, num_kv_heads=Hkv, width=width, layer=jnp.int32(layer),
                                       implementation="xla", **kw)
    assert count == 0 or not np.array_equal(want, np.asarray(out))
    f, c = jnp.int32(first), jnp.int32(count)
    got = gpu.select_span_gpu(heats, cands, ret, plan, out, f, c, span=4, interpret=True, **kw)
    np.testing.assert_array_equal(np.asarray(got), want)
    got = select_span(heats, cands, ret, plan, out, f, c, span=4, implementation="xla", **kw)
    np.testing.assert_array_equal(np.asarray(got), want)
