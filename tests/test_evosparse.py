"""EvoSparse: dense at a full budget, masked-reference equality with fixed sets, the heat recurrence against a
NumPy step-by-step reference, one jitted decode loop carrying the state, exact T > 1, calibration, errors."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct

from jsparse.artifacts import Artifact, ArtifactError, save_artifact
from jsparse.methods import evosparse_calibration as ecal
from jsparse.methods import make_method
from jsparse.methods.evosparse import (DEFAULT_FRACTIONS, EvoSparse, EvoState, _cumulative_fixed, ablation_fractions,
                                      split_counts)
from jsparse.methods.evosparse_calibration import _ArgmaxRecorder, calibrate, head_scores
from models import llama
from models.attention import LayerContext, LayerKV
from models.cache import init_cache
from models.config import ModelConfig
from models.generate import Sampling, generate_tokens
from models.params import random_params
from pallas_kernels.dense import dense_decode
from pallas_kernels.sparse_attention.reference import masked_attention_reference
from jsparse.methods.evosparse_calibration import INTRO, NEEDLE, QUESTION, needle_prompt, special_prefix
from types import SimpleNamespace

B, HQ, HKV, D = 2, 4, 2, 16
G = HQ // HKV
CFG = ModelConfig(architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=5,
                  num_heads=HQ, num_kv_heads=HKV, head_dim=D, max_position_embeddings=512, eos_token_ids=(3,))
HEADS = [(1, 0), (3, 2), (3, 3)]  # layer 1 (dense) computes a set, layer 2 inherits it, 3 computes, 4 inherits
FRACTIONS = DEFAULT_FRACTIONS  # (1/16, 3/8, 5/16, 1/4)


@pytest.fixture(scope="module")
def params():
    return random_params(CFG, jax.random.key(0), jnp.float32, scale=0.4)


def _inputs(seed, N=128, T=1, lengths=(77, 128)):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (B, T, HQ, D), jnp.float32)
    k = jax.random.normal(ks[1], (B, HKV, N, D), jnp.float32)
    v = jax.random.normal(ks[2], (B, HKV, N, D), jnp.float32)
    return q, LayerKV(k=k, v=v), jnp.asarray(lengths, jnp.int32)


def _ctx(layer, lengths, info=None):
    return LayerContext(layer=jnp.int32(layer), lengths=lengths, info=info)


def _info(m, layer):
    info = m.layer_info(CFG)
    return None if info is None else jax.tree_util.tree_map(lambda x: x[layer], info)


@jax.jit
def _decode(m, layer, lengths, q, cache, state):
    """One layer's decode, jitted (eager dispatch of every op is slower than one compile)."""
    return m.decode(_ctx(layer, lengths, _info(m, layer)), q, cache, state)


# --------------------------------------------------------------------------------------------- numpy reference


def _counts_np(kb):
    cum = np.cumsum(FRACTIONS)
    ends = [math.ceil(round(c * 4096) * kb / 4096) for c in cum[:-1]] + [kb]
    counts = [e - s for s, e in zip([0] + ends[:-1], ends)]
    if kb >= 1 and counts[1] == 0:  # the local window (the query's own block) takes a block from the first
        j = next(i for i, c in enumerate(counts) if c > 0)
        counts[j] -= 1
        counts[1] = 1
    return counts


def _select_np(p, bs, budget_tokens, heat, ret, ret_heads, q, k):
    """Blocks one row attends, per KV head, and the retrieval set (f64 numpy).

    p: position; heat: f64[Hkv, nb] or None; ret: the inherited retrieval list (or None when ret_heads is given);
    ret_heads: [(kv head, g)] of this layer (empty: inherit); q: [Hq, D]; k: [Hkv, N, D].
    """
    kb = -(-min(budget_tokens, p + 1) // bs)
    nbv = p // bs + 1
    if kb >= nbv:
        return [list(range(nbv))] * HKV, ret if not ret_heads else []
    n_s, n_l, n_r, n_h = _counts_np(kb)
    sink, local = list(range(n_s)), list(range(nbv - n_l, nbv))
    middle = [b for b in range(nbv) if n_s <= b < nbv - n_l]
    if ret_heads:
        tok = np.full(k.shape[1], -np.inf)
        for h, g in ret_heads:
            tok = np.maximum(tok, k[h] @ q[h * G + g] / math.sqrt(D))
        tok[p + 1:] = -np.inf
        bmax = np.array([tok[b * bs:(b + 1) * bs].max() for b in range(k.shape[1] // bs)])
        order = sorted(middle, key=lambda b: (-bmax[b], b))
        ret = sorted(order[:n_r])
    sets = []
    for h in range(HKV):
        cand = [b for b in middle if b not in ret]
        order = sorted(cand, key=lambda b: (-heat[h, b], b))
        sets.append(sorted(sink + local + list(ret) + order[:n_h + n_r - len(ret)]))
    return sets, ret


def _attend_np(p, bs, sets, q, k, v):
    """Output [Hq, D] and block mass f64[Hkv, nb] of one row over the given block sets."""
    nb = k.shape[1] // bs
    out = np.zeros((HQ, D))
    mass = np.zeros((HKV, nb))
    for h in range(HQ):
        kv = h // G
        toks = [t for b in sets[kv] for t in range(b * bs, (b + 1) * bs) if t <= p]
        s = k[kv, toks] @ q[h] / math.sqrt(D)
        w = np.exp(s - s.max())
        w /= w.sum()
        out[h] = w @ v[kv, toks]
        for t, wt in zip(toks, w):
            mass[kv, t // bs] += wt / G
    return out, mass


# --------------------------------------------------------------------------------------------- layer tests


DROPS = {"evosparse": (), "evosparse-noheat": ("heat",), "evosparse-noretrieval": ("retrieval",),
         "sink-local": ("retrieval", "heat")}


def _variant(name, **options):
    fr = ablation_fractions(FRACTIONS, DROPS[name])
    return EvoSparse.from_heads(CFG, HEADS, **dict(zip(("sink_fraction", "local_fraction", "retrieval_fraction",
                                                        "heat_fraction"), fr)), **options)


def test_noheat_reports_the_layers_before_its_first_retrieval_layer_as_they_attend():
    """Without heat, a sparse layer before the first retrieval layer has no retrieval set and nothing to give its
    slots to: it attends its sink and local blocks only, and achieved_sparsity counts it so (it counted the whole
    budget, reporting less sparsity than attended)."""
    fr = dict(zip(("sink_fraction", "local_fraction", "retrieval_fraction", "heat_fraction"),
                  ablation_fractions(FRACTIONS, DROPS["evosparse-noheat"])))
    late = EvoSparse.from_heads(CFG, [(3, 0)], budget_tokens=64, block_size=8, **fr)  # layer 2 starved
    early = EvoSparse.from_heads(CFG, [(1, 0)], budget_tokens=64, block_size=8, **fr)  # none starved
    p = np.arange(100, 400)
    full = np.mean(1.0 - (np.minimum(8 * 8 - (7 - p % 8), p + 1)) / (p + 1))  # 64 tokens: 8 whole blocks
    assert early.achieved_sparsity(CFG, p) == pytest.approx(3 / 5 * full)
    kb, visible, counts = early._row_budget(p)
    own = np.asarray(counts[0]) + np.asarray(counts[1])  # sink + local blocks
    assert (own < 8).all()
    part = np.mean(1.0 - np.minimum(own * 8 - (7 - p % 8), p + 1) / (p + 1))
    assert late.achieved_sparsity(CFG, p) == pytest.approx((2 * full + part) / 5)
    assert late.achieved_sparsity(CFG, p) > early.achieved_sparsity(CFG, p)


@pytest.mark.parametrize("name,T", [("evosparse", 1), ("evosparse", 3), ("evosparse-noheat", 1),
                                    ("evosparse-noretrieval", 3), ("sink-local", 1)])
def test_full_budget_equals_dense(name, T):
    q, cache, lengths = _inputs(0, T=T)
    m = _variant(name, budget=1.0, min_tokens=1)
    want = dense_decode(q, cache.k, cache.v, lengths)
    for layer in (2, 3):  # inherits / computes retrieval
        state = m.start(CFG, m.init_state(CFG, B, 128), "decode", B, T, 128)
        out, _ = _decode(m, layer, lengths, q, cache, state)
        np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("budget", [64, 16, 8])
def test_fixed_sets_equal_masked_reference(budget):
    """Given heat and an inherited retrieval set, the layer attends exactly sink + local + retrieval + heat; at
    budgets of two blocks and one the local window (the query's own block) still has one."""
    q, cache, lengths = _inputs(1)
    bs = 8
    kb = budget // bs
    m = EvoSparse.from_heads(CFG, HEADS, budget_tokens=budget, block_size=bs)
    counts = {8: (1, 3, 2, 2), 2: (0, 1, 1, 0), 1: (0, 1, 0, 0)}[kb]  # 8: 1 sink, 3 local, 2 ret, 2 heat
    assert split_counts(kb, _cumulative_fixed(m.fractions), ensure=1) == counts == tuple(_counts_np(kb))
    heat = jax.random.uniform(jax.random.key(2), (CFG.num_layers, B, HKV, 16))
    state = m.start(CFG, EvoState(heat=heat), "decode", B, 1, 128)
    # A retrieval set is ascending (`block_scores.select_blocks`; the GPU kernel binary-searches it): an unsorted
    # [9, 2] here lost both blocks on an H200 while the XLA path, which does not search, kept them.
    ret = np.array([[[3, 6, -1]], [[2, 9, -1]]], np.int32)[:, :, : state.retrieval.shape[-1]]
    ret = np.where(np.arange(ret.shape[-1]) < counts[2], ret, -1)  # a retrieval layer's set holds n_r blocks
    state = state.replace(retrieval=jnp.asarray(ret))
    out, new_state = _decode(m, 2, lengths, q, cache, state)  # layer 2: inherits
    qn, kn, vn = (np.asarray(x, np.float64) for x in (q, cache.k, cache.v))
    mask = np.zeros((B, HKV, 1, 128), bool)
    for b in range(B):
        p = int(lengths[b]) - 1
        sets, _ = _select_np(p, bs, budget, np.asarray(heat[2, b], np.float64), list(ret[b, 0][ret[b, 0] >= 0]),
                             [], qn[b, 0], kn[b])
        for h in range(HKV):
            for blk in sets[h]:
                mask[b, h, 0, blk * bs:(blk + 1) * bs] = True
            assert p // bs in sets[h]  # its own block
        assert len(sets[0]) == kb
    mask &= np.arange(128)[None, None, None] < np.asarray(lengths)[:, None, None, None]
    want = masked_attention_reference(q, cache.k, cache.v, jnp.asarray(mask))
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(new_state.retrieval, ret)  # inherited unchanged
    # The heat of layer 2 is lambda * h + the block mass (start decays every sparse layer, the layer adds its
    # mass); the layer touches no other layer's heat.
    _, mass = zip(*[_attend_np(int(lengths[b]) - 1, bs, [np.flatnonzero(mask[b, h, 0, ::bs]) for h in range(HKV)],
                               qn[b, 0], kn[b], vn[b]) for b in range(B)])
    np.testing.assert_allclose(new_state.heat[2], m.decay * np.asarray(heat[2]) + np.stack(mass), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(new_state.heat[3], state.heat[3])
    np.testing.assert_array_equal(state.heat[3], m.decay * heat[3])
    np.testing.assert_array_equal(state.heat[:m.dense_layers], heat[:m.dense_layers])  # dense layers: no decay


def test_retrieval_layer_computes_block_max_topk():
    q, cache, lengths = _inputs(3)
    m = EvoSparse.from_heads(CFG, HEADS, budget_tokens=64, block_size=8)
    state = m.start(CFG, m.init_state(CFG, B, 128), "decode", B, 1, 128)
    _, st = _decode(m, 3, lengths, q, cache, state)
    qn, kn = np.asarray(q, np.float64), np.asarray(cache.k, np.float64)
    for b in range(B):
        _, ret = _select_np(int(lengths[b]) - 1, 8, 64, np.zeros((HKV, 16)), None, [(1, 0), (1, 1)], qn[b, 0], kn[b])
        got = np.asarray(st.retrieval[b, 0])
        assert list(got[got >= 0]) == ret and len(ret) == 2


def test_prefill_is_dense_and_initialises_heat():
    T, W = 40, 8
    ks = jax.random.split(jax.random.key(4), 3)
    q = jax.random.normal(ks[0], (B, T, HQ, D))
    k = jax.random.normal(ks[1], (B, T, HKV, D))
    v = jax.random.normal(ks[2], (B, T, HKV, D))
    lengths = jnp.array([T, 29])
    m = EvoSparse.from_heads(CFG, HEADS, budget_tokens=16, block_size=8, heat_window=W, decay=0.5)
    state = m.init_state(CFG, B, 64)
    out, st = m.prefill(_ctx(3, lengths), q, k, v, state)
    from pallas_kernels.dense import dense_prefill
    np.testing.assert_allclose(out, dense_prefill(q, k, v), rtol=1e-5, atol=1e-5)
    qn, kn = np.asarray(q, np.float64), np.asarray(k, np.float64)
    for b in range(B):
        n = int(lengths[b])
        want = np.zeros((HKV, 8))
        for r in range(n - W, n):
            for h in range(HQ):
                s = kn[b, : r + 1, h // G] @ qn[b, r, h] / math.sqrt(D)
                p = np.exp(s - s.max())
                p /= p.sum()
                for t in range(r + 1):
                    want[h // G, t // 8] += 0.5 ** (n - 1 - r) * p[t] / G
        np.testing.assert_allclose(st.heat[3, b], want, rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(st.heat[2]).max()) == 0.0


# --------------------------------------------------------------------------------------------- model tests


@struct.dataclass
class _Recording:
    """Wraps EvoSparse and records, per decode layer, the query and the retrieval set after the layer."""

    inner: EvoSparse

    def init_state(self, cfg, batch, max_len):
        wr = self.inner.widths(max_len)["retrieval"]
        return (self.inner.init_state(cfg, batch, max_len),
                jnp.zeros((cfg.num_layers, batch, cfg.num_heads, cfg.head_dim)),
                jnp.zeros((cfg.num_layers, batch, wr), jnp.int32))

    def layer_info(self, cfg):
        return self.inner.layer_info(cfg)

    def start(self, cfg, state, phase, batch, q_len, kv_len):
        return (self.inner.start(cfg, state[0], phase, batch, q_len, kv_len),) + state[1:]

    def start_rows(self, cfg, state, phase, lengths, q_len, kv_len):  # the heat candidates: the model's own path
        return (self.inner.start_rows(cfg, state[0], phase, lengths, q_len, kv_len),) + state[1:]

    def finish(self, state, phase):
        return (self.inner.finish(state[0], phase),) + state[1:]

    def prefill(self, ctx, q, k, v, state):
        out, s = self.inner.prefill(ctx, q, k, v, state[0])
        return out, (s,) + state[1:]

    def decode(self, ctx, q, cache, state):
        out, s = self.inner.decode(ctx, q, cache, state[0])
        return out, (s, state[1].at[ctx.layer].set(q[:, 0]), state[2].at[ctx.layer].set(s.retrieval[:, 0]))


def _decode_loop(params, method, tokens, steps, capacity):
    """Prefill, then `steps` greedy decode steps in one jitted lax.scan; returns per-step states and the cache."""

    @jax.jit
    def run(params, method, tokens):
        Bn, T = tokens.shape
        cache = init_cache(CFG, Bn, capacity, jnp.float32)
        state = method.init_state(CFG, Bn, capacity)
        logits, cache, state = llama.prefill(params, CFG, method, tokens, jnp.full((Bn,), T), cache, state)
        tok = jnp.argmax(logits, -1).astype(jnp.int32)

        def body(carry, _):
            tok, cache, state = carry
            logits, cache, state = llama.decode(params, CFG, method, tok[:, None], cache, state)
            new = jnp.argmax(logits[:, 0], -1).astype(jnp.int32)
            return (new, cache, state), state

        (_, cache, _), states = jax.lax.scan(body, (tok, cache, state), None, length=steps)
        return state, states, cache

    return run(params, method, tokens)


def test_heat_recurrence_matches_numpy_over_20_steps(params):
    bs, budget, steps, P0, N = 8, 40, 20, 96, 128
    m = EvoSparse.from_heads(CFG, HEADS, budget_tokens=budget, block_size=bs, heat_window=8, decay=0.8)
    tokens = jax.random.randint(jax.random.key(5), (B, P0), 4, CFG.vocab_size)
    state0, states, cache = _decode_loop(params, _Recording(m), tokens, steps, N)
    heat = np.asarray(state0[0].heat, np.float64)  # after prefill (its rule is tested above)
    kn, vn = np.asarray(cache.k, np.float64), np.asarray(cache.v, np.float64)
    qs, rets, heats = np.asarray(states[1], np.float64), np.asarray(states[2]), np.asarray(states[0].heat)
    layout = {1: [(0, 0)], 3: [(1, 0), (1, 1)]}
    for t in range(steps):
        p = P0 + t
        for b in range(B):
            ret = []
            for layer in range(CFG.num_layers):
                q = qs[t, layer, b]
                if layer in layout or layer >= 2:
                    sets, ret = _select_np(p, bs, budget, heat[layer, b], ret, layout.get(layer, []), q,
                                           kn[layer, b])
                    got = rets[t, layer, b]
                    assert list(got[got >= 0]) == list(ret), (t, layer, b)
                if layer >= 2:
                    _, mass = _attend_np(p, bs, sets, q, kn[layer, b], vn[layer, b])
                    heat[layer, b] = 0.8 * heat[layer, b] + mass
        np.testing.assert_allclose(heats[t], heat, rtol=1e-4, atol=1e-6, err_msg=f"step {t}")
    # the state really changes across the steps of the one jitted loop
    assert not np.allclose(heats[0], heats[-1])
    assert (np.asarray(rets[:, 3]) != np.asarray(rets[0, 3])).any() or (rets[:, 3] >= 0).all()


def test_several_new_tokens_equal_sequential_decode(params):
    """T > 1 rows in one decode call (perplexity's decode simulation) equal T single-token decode steps."""
    m = EvoSparse.from_heads(CFG, HEADS, budget_tokens=40, block_size=8, heat_window=8)
    tokens = jax.random.randint(jax.random.key(6), (B, 70), 4, CFG.vocab_size)
    prefix, T = 60, 10

    @jax.jit
    def both(params, method, tokens):
        cache = init_cache(CFG, B, 128, jnp.float32)
        _, cache, state = llama.prefill(params, CFG, method, tokens[:, :prefix], jnp.full((B,), prefix), cache,
                                        method.init_state(CFG, B, 128))
        many, _, s_many = llama.decode(params, CFG, method, tokens[:, prefix:], cache, state)

        def body(carry, tok):
            cache, state = carry
            logits, cache, state = llama.decode(params, CFG, method, tok[:, None], cache, state)
            return (cache, state), logits[:, 0]

        (_, s_one), one = jax.lax.scan(body, (cache, state), tokens[:, prefix:].T)
        return many, jnp.swapaxes(one, 0, 1), s_many.heat, s_one.heat

    many, one, h_many, h_one = both(params, m, tokens)
    np.testing.assert_allclose(many, one, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(h_many, h_one, rtol=2e-4, atol=1e-6)
    assert T == many.shape[1]


def test_generate_full_budget_equals_dense_and_compiles_once(params):
    tokens = jax.random.randint(jax.random.key(7), (B, 48), 4, CFG.vocab_size)
    lengths = jnp.array([48, 37])
    kw = dict(cfg=CFG, max_new_tokens=10, capacity=128, sampling=Sampling())
    dense, _ = generate_tokens(params, make_method("dense"), tokens, lengths, jax.random.key(0), **kw)
    full = EvoSparse.from_heads(CFG, HEADS, budget=1.0, min_tokens=1, block_size=8)
    before = generate_tokens._cache_size()
    got, _ = generate_tokens(params, full, tokens, lengths, jax.random.key(0), **kw)
    np.testing.assert_array_equal(got, dense)
    other = EvoSparse.from_heads(CFG, [(1, 1), (3, 0), (3, 1)], budget=1.0, min_tokens=1, block_size=8)
    got, _ = generate_tokens(params, other, tokens, lengths, jax.random.key(0), **kw)
    np.testing.assert_array_equal(got, dense)
    assert generate_tokens._cache_size() == before + 1  # other heads in the same layers are data: no retrace
    moved = EvoSparse.from_heads(CFG, [(3, 1), (4, 0), (2, 3)], budget=1.0, min_tokens=1, block_size=8)
    got, _ = generate_tokens(params, moved, tokens, lengths, jax.random.key(0), **kw)
    np.testing.assert_array_equal(got, dense)
    assert generate_tokens._cache_size() == before + 2  # the layers holding them are static (`segments`)


# --------------------------------------------------------------------------------------------- calibration


class _WordTokenizer:
    """A whitespace tokenizer over a fixed vocabulary (enough for the calibration's prompt building)."""

    def __init__(self, vocab):
        self.vocab = {w: i for i, w in enumerate(vocab)}

    def __call__(self, text, add_special_tokens=True, **_):
        ids = [self.vocab.get(w, 1) for w in text.replace(".", " .").replace("?", " ?").replace(":", " :").split()]
        return {"input_ids": ids}


def test_calibration_scores_and_artifact(params):
    from jsparse.methods.evosparse_calibration import WORDS

    class Model:
        cfg, name = CFG, "tiny"
    Model.params = params
    Model.tokenizer = _WordTokenizer(["<pad>", "<unk>"] + list(WORDS)[:60])
    windows = np.asarray(jax.random.randint(jax.random.key(8), (1, 128), 4, CFG.vocab_size))
    art = calibrate(Model, windows, lengths=[128], depths=[0.3, 0.7], needle_words=4)
    assert art.kind == "evosparse" and art.arrays["scores"].shape == (CFG.num_layers, HQ)
    assert art.meta["prompts"] == 2 and 0.0 <= art.arrays["scores"].min() <= art.arrays["scores"].max() <= 1.0
    # The CLI names an empty list and a --length too short for its default prompts (numpy's "max() iterable
    # argument is empty" before, or an error blaming --prompt-lengths the user never gave).
    from jsparse.methods.evosparse_calibration import run_cli
    base = dict(prompt_lengths=None, depths="0.5", needle_words=4, min_recall=0.5, seed=0)
    for extra, match in (({"depths": ","}, "--depths ',': expected at least one needle depth"),
                         ({"prompt_lengths": ","}, "--prompt-lengths ',': expected at least one length")):
        with pytest.raises(ValueError, match=match):
            run_cli(Model, windows, SimpleNamespace(**{**base, **extra}))
    with pytest.raises(ValueError, match="--length 100: the default needle prompts .* expected --length >= 128"):
        run_cli(Model, windows[:, :100], SimpleNamespace(**base))
    with pytest.raises(ValueError, match="--prompt-lengths value 200: expected between 64 and --length 128"):
        run_cli(Model, windows, SimpleNamespace(**{**base, "prompt_lengths": "64,200"}))
    with pytest.raises(ValueError, match=r"min_recall=0.0: expected a fraction in \(0, 1\]"):
        calibrate(Model, windows, lengths=[64], min_recall=0.0)
    with pytest.raises(ValueError, match=r"depth 1.5: expected a fraction in \[0, 1\]"):
        calibrate(Model, windows, lengths=[64], depths=[0.5, 1.5])


def test_calibration_counts_a_prompt_at_exactly_min_recall(monkeypatch):
    """The head scores are averaged over the prompts where the model retrieved the needle, "at least `min_recall` of
    the needle tokens reproduced": a prompt whose recall equals min_recall counts (with `>` for `>=` a needle of 8
    tokens copied 4 times would be dropped at the default 0.5). The model run is stubbed to give the outcomes."""
    L = CFG.num_layers
    # Prompt 0 copies half its needle (recall 0.5 == min_recall), prompt 1 a quarter.
    outcomes = iter([(np.ones((1, L, HQ)), np.array([0.5])), (np.zeros((1, L, HQ)), np.array([0.25]))])
    monkeypatch.setattr(ecal, "special_prefix", lambda tok: [])
    monkeypatch.setattr(ecal, "needle_prompt",
                        lambda tok, filler, length, depth, words: (np.zeros(length, np.int32), 10,
                                                                   np.arange(4, dtype=np.int32)))
    monkeypatch.setattr(ecal, "copy_run", lambda params, tokens, lengths, *, cfg, steps, capacity: (
        np.zeros((steps, tokens.shape[0]), np.int32), np.zeros((steps, L, tokens.shape[0], HQ), np.int32)))
    monkeypatch.setattr(ecal, "head_scores", lambda tokens, gen, am, starts, needles: next(outcomes))

    class Model:
        cfg, params, tokenizer, name = CFG, None, None, "stub"

    art = calibrate(Model, np.zeros((2, 64), np.int32), lengths=[64], depths=[0.5], min_recall=0.5)
    assert art.meta["retrieved_prompts"] == 1 and art.meta["fallback"] is None
    np.testing.assert_allclose(art.arrays["scores"], np.ones((L, HQ)))  # the retrieving prompt's scores alone
    np.testing.assert_allclose(art.arrays["recall"], [0.5, 0.25])
    # No prompt at min_recall: every prompt's mean, said by a warning beside meta["fallback"].
    outcomes = iter([(np.ones((1, L, HQ)), np.array([0.5])), (np.zeros((1, L, HQ)), np.array([0.25]))])
    with pytest.warns(UserWarning, match=r"no needle prompt of 2 reached min_recall=0.9 \(mean recall 0.375\)"):
        art = calibrate(Model, np.zeros((2, 64), np.int32), lengths=[64], depths=[0.5], min_recall=0.9)
    assert art.meta["retrieved_prompts"] == 0 and art.meta["fallback"] == "all prompts"
    np.testing.assert_allclose(art.arrays["scores"], np.full((L, HQ), 0.5))


def test_head_scores_counts_copy_events():
    tokens = np.array([[5, 6, 7, 8, 9, 10]])
    gen = np.array([[7], [8], [2]])  # S=3, B=1: copies 7 and 8, then a miss
    am = np.zeros((3, 1, 1, 2), np.int32)
    am[:, 0, 0, 0] = [2, 3, 3]  # head 0 looks at the right needle position when copying
    am[:, 0, 0, 1] = [0, 2, 4]  # head 1 looks elsewhere / at the wrong needle token
    scores, recall = head_scores(tokens, gen, am, [2], [np.array([7, 8, 9])])
    np.testing.assert_allclose(scores[0, 0], [2 / 3, 0.0])
    np.testing.assert_allclose(recall, [2 / 3])


def test_argmax_recorder_matches_numpy():
    q, cache, lengths = _inputs(9)
    rec = _ArgmaxRecorder()
    _, st = rec.decode(_ctx(0, lengths), q, cache, rec.init_state(CFG, B, 128))
    for b in range(B):
        n = int(lengths[b])
        for h in range(HQ):
            s = np.asarray(cache.k[b, h // G, :n]) @ np.asarray(q[b, 0, h])
            assert int(st.argmax[0, b, h]) == int(np.argmax(s))


# --------------------------------------------------------------------------------------------- errors


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="sum to 1.1.*sink_fraction=0.2"):
        EvoSparse(sink_fraction=0.2, local_fraction=0.3, retrieval_fraction=0.3, heat_fraction=0.3)
    with pytest.raises(ValueError, match="block_size=24: expected a divisor of the kernel block of 128"):
        EvoSparse(block_size=24)
    for bad in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match=f"decay={bad}: expected lambda in the open interval"):
            EvoSparse(decay=bad)
    with pytest.raises(ValueError, match="budget_tokens=0"):
        EvoSparse(budget_tokens=0)
    with pytest.raises(ValueError, match="needs its retrieval heads"):
        make_method("evosparse", cfg=CFG)
    path = str(tmp_path / "art")
    save_artifact(path, Artifact(kind="evosparse", fingerprint="aaaa", arrays={"scores": np.ones((5, 4), np.float32)}))
    assert make_method("evosparse", cfg=CFG, artifact=path, fingerprint="aaaa").layout is not None
    with pytest.raises(ArtifactError, match="calibrated for model fingerprint 'aaaa'"):
        make_method("evosparse", cfg=CFG, artifact=path, fingerprint="bbbb")
    with pytest.raises(ArtifactError, match="calibrated for model fingerprint"):
        make_method("evosparse-noheat", cfg=CFG, artifact=path, fingerprint="bbbb")
    # ablations: the dropped share goes to the rest in proportion; no artifact needed without retrieval
    assert make_method("sink-local", cfg=CFG).fractions == pytest.approx((1 / 7, 6 / 7, 0.0, 0.0))
    assert make_method("evosparse-noretrieval", cfg=CFG).fractions == pytest.approx(
        ablation_fractions(FRACTIONS, ("retrieval",)))
    # A split the user gives is taken as given (it was rescaled, and a dropped component's share ignored).
    assert make_method("sink-local", cfg=CFG, sink_fraction=0.25, local_fraction=0.75).fractions == (0.25, 0.75, 0, 0)
    with pytest.raises(ValueError, match="budget fractions sum to 0.875"):
        make_method("sink-local", cfg=CFG, sink_fraction=0.5)
    with pytest.raises(ValueError, match="heat_fraction=0.9: this ablation drops the heat component"):
        make_method("evosparse-noheat", cfg=CFG, heat_fraction=0.9)
    # The local window holds the query's own block: a share that rounds to no block is refused (the own position
    # went unattended).
    for local in (0.0, 1e-5):
        with pytest.raises(ValueError, match=f"local_fraction={local}: expected at least 1/4096"):
            EvoSparse(sink_fraction=0.0625, local_fraction=local, retrieval_fraction=0.6875 - local,
                      heat_fraction=0.25)
    # Integer layers and heads only (True read as layer 1, 1.7 as 1).
    with pytest.raises(ValueError, match=r"retrieval_layers=\(True,\)"):
        EvoSparse(retrieval_layers=(True,))
    with pytest.raises(ValueError, match=r"retrieval head \(layer=1.7, head=0.9\): expected integer indices"):
        EvoSparse.from_heads(CFG, [(1.7, 0.9)])


def _attended_blocks(m, ret, pos, N, heat):
    idx = np.asarray(m.select_blocks(heat, ret, pos, HKV, N))  # [B, Hkv, Kb]
    for row in idx.reshape(-1, idx.shape[-1]):  # valid entries distinct and within the visible blocks
        v = row[row >= 0]
        assert len(set(v.tolist())) == len(v)
    return (idx >= 0).sum(-1)  # [B, Hkv]


def test_empty_retrieval_slots_are_filled_by_heat():
    """Retrieval slots left empty (a sparse layer before the first retrieval layer, or a short set) go to heat, so
    the layer still attends its whole block budget kb = n_s + n_l + n_r + n_h."""
    bs, N = 8, 256
    m = EvoSparse.from_heads(CFG, [(3, 0)], budget_tokens=64, block_size=bs)  # layers 1, 2: no set yet
    pos = jnp.asarray([200, 255], jnp.int32)
    kb, nbv, (n_s, n_l, n_r, n_h) = m._row_budget(pos)
    kb, nbv, n_r = np.asarray(kb), np.asarray(nbv), np.asarray(n_r)
    assert (kb < nbv).all() and (n_r > 0).all()  # a sparse row with retrieval slots
    heat = jax.random.uniform(jax.random.key(0), (B, HKV, N // bs), jnp.float32)
    wr = m.widths(N)["retrieval"]
    empty = jnp.full((B, wr), -1, jnp.int32)
    np.testing.assert_array_equal(_attended_blocks(m, empty, pos, N, heat), np.broadcast_to(kb[:, None], (B, HKV)))
    # a set holding one block: the other n_r - 1 slots go to heat, the total is kb again
    one = empty.at[:, 0].set(jnp.asarray([10, 12], jnp.int32))
    np.testing.assert_array_equal(_attended_blocks(m, one, pos, N, heat), np.broadcast_to(kb[:, None], (B, HKV)))


def test_head_scores_ignores_a_copy_from_just_past_the_needle():
    """A head that copies the generated token from the key just past the needle is no retrieval head."""
    tokens = np.array([[5, 6, 7, 8, 7, 10]])  # needle 7, 8 at 2..3; another 7 right after it, at 4
    gen = np.array([[7], [8]])
    am = np.zeros((2, 1, 1, 2), np.int32)
    am[:, 0, 0, 0] = [2, 3]  # head 0 copies from the needle
    am[:, 0, 0, 1] = [4, 1]  # head 1 copies the 7 just past the needle, then looks elsewhere
    scores, recall = head_scores(tokens, gen, am, [2], [np.array([7, 8])])
    np.testing.assert_allclose(scores[0, 0], [1.0, 0.0])
    np.testing.assert_allclose(recall, [1.0])


def test_duplicate_retrieval_layers_are_refused():
    with pytest.raises(ValueError, match=r"retrieval_layers=\(1, 1\): expected ascending distinct layer indices"):
        EvoSparse(retrieval_layers=(1, 1))


def test_check_model_refuses_a_layout_of_another_gqa_group_without_layout_heads():
    """A layout built without `from_heads` (no layout_heads): its GQA group size is still checked."""
    from jsparse.retrieval_heads import retrieval_layout

    other = ModelConfig(architecture="llama", vocab_size=64, hidden_size=48, intermediate_size=64, num_layers=5,
                        num_heads=6, num_kv_heads=2, head_dim=D, max_position_embeddings=512, eos_token_ids=(3,))
    m = EvoSparse(layout=retrieval_layout(other, [(1, 0)]))
    with pytest.raises(ValueError, match=r"placed for a model of GQA groups of 3 query heads, but this model has "
                                         r"Hq, Hkv = \(4, 2\)"):
        m.check_model(CFG)
    EvoSparse(layout=retrieval_layout(CFG, [(1, 0)])).check_model(CFG)  # its own group size: accepted


def test_decode_refuses_a_cache_capacity_not_a_multiple_of_block_size():
    q, cache, lengths = _inputs(0, N=100, lengths=(77, 100))
    m = EvoSparse.from_heads(CFG, HEADS, budget_tokens=32, block_size=16)
    state = m.start(CFG, m.init_state(CFG, B, 100), "decode", B, 1, 100)
    with pytest.raises(ValueError, match="cache capacity N=100 is not a multiple of block_size=16"):
        _decode(m, 3, lengths, q, cache, state)


class _BosWordTokenizer(_WordTokenizer):
    """The word tokenizer with a [BOS] (id 0) before the text when adding special tokens, as most LLM tokenizers."""

    def __call__(self, text, add_special_tokens=True, **kw):
        ids = super().__call__(text, **kw)["input_ids"]
        return {"input_ids": ([0] if add_special_tokens else []) + ids}


def _bos_tokenizer():
    from jsparse.methods.evosparse_calibration import WORDS

    return _BosWordTokenizer(["<bos>", "<unk>"] + list(WORDS)[:60])


def test_needle_prompt_layout_with_a_bos_tokenizer():
    """[BOS] INTRO FILLER[:d] NEEDLE FILLER[d:] QUESTION (the module docstring), one [BOS] only, the start pointing at
    the needle's words, and a length that leaves no filler refused with the shortest length that works."""
    tok = _bos_tokenizer()
    ids = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert special_prefix(tok) == [0]
    words = ["apple", "river", "stone"]
    filler = np.arange(100, 160, dtype=np.int32)
    head, tail = [0] + ids(INTRO), ids(QUESTION)
    needle = ids(NEEDLE) + ids(" apple river stone") + ids(".")
    length = 80
    n_fill = length - len(head) - len(needle) - len(tail)
    tokens, start, needle_ids = needle_prompt(tok, filler, length, 0.5, words)
    before = int(round(0.5 * n_fill))
    want = head + list(range(100, 100 + before)) + needle + list(range(100 + before, 100 + n_fill)) + tail
    np.testing.assert_array_equal(tokens, want)
    np.testing.assert_array_equal(needle_ids, ids(" apple river stone"))
    np.testing.assert_array_equal(tokens[start:start + len(needle_ids)], needle_ids)
    short = length - n_fill  # no filler at all
    with pytest.raises(ValueError, match=rf"needle prompt length={short} \(--prompt-lengths\) is too short: .*the "
                                         rf"needle of 3 words \(--needle-words\).* expected a length >= {short + 1}"):
        needle_prompt(tok, filler, short, 0.5, words)


def test_head_scores_divides_by_each_prompts_own_needle_length():
    """A batch decodes for the longest needle (S steps); a prompt with a shorter needle of n tokens scores its copy
    events / n, over its first n steps only."""
    tokens = np.array([[5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 9, 10]])
    gen = np.array([[7, 7], [8, 8], [9, 9]])  # S = 3 steps for both rows
    am = np.zeros((3, 1, 2, 1), np.int32)
    am[:, 0, 0, 0] = [2, 3, 4]  # row 0 (needle of 3): three copy events
    am[:, 0, 1, 0] = [2, 3, 4]  # row 1 (needle of 2): two within its needle, the third step is past it
    scores, recall = head_scores(tokens, gen, am, [2, 2], [np.array([7, 8, 9]), np.array([7, 8])])
    np.testing.assert_allclose(scores[:, 0, 0], [1.0, 1.0])
    np.testing.assert_allclose(recall, [1.0, 1.0])


def test_argmax_recorder_ignores_keys_past_the_length():
    """The top-1 key is taken among the keys before n_valid: a key at position n_valid, however large its score,
    is not attended (decode) and in prefill the query is each row's last valid one, not the padding's."""
    rng = np.random.default_rng(0)
    T, n = 16, np.array([9, 16])
    q = rng.normal(size=(B, T, HQ, D)).astype(np.float32)
    k = rng.normal(size=(B, T, HKV, D)).astype(np.float32)
    k[0, 9] = 50.0 * np.sign(q[0, 8].reshape(HKV, G, D).sum(1))  # the first padding key of row 0 would win
    v = rng.normal(size=(B, T, HKV, D)).astype(np.float32)
    got = np.asarray(_ArgmaxRecorder._argmax(jnp.asarray(q[:, 8]), jnp.asarray(k.swapaxes(1, 2)), jnp.asarray(n)))
    for b in range(B):
        for h in range(HQ):
            assert got[b, h] == np.argmax(k[b, :n[b], h // G] @ q[b, 8, h]), (b, h)
    rec = _ArgmaxRecorder()
    _, st = rec.prefill(_ctx(0, jnp.asarray(n, jnp.int32)), jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                        rec.init_state(CFG, B, T))
    for b in range(B):
        for h in range(HQ):
            want = np.argmax(k[b, :n[b], h // G] @ q[b, n[b] - 1, h])
            assert int(st.argmax[0, b, h]) == want, (b, h)


def test_calibration_decodes_for_the_longest_needle_and_skips_the_special_prefix(monkeypatch):
    """Needles of different token counts in one batch: the model decodes max(|needle|) steps; the filler is the
    window past the tokenizer's special prefix (the windows start with [BOS])."""
    L = CFG.num_layers
    seen = {}
    monkeypatch.setattr(ecal, "needle_prompt", lambda tok, filler, length, depth, words: (
        seen.setdefault("fillers", []).append(np.asarray(filler)) or np.zeros(length, np.int32), 10,
        np.arange(3 if depth < 0.5 else 5, dtype=np.int32)))

    def copy_run(params, tokens, lengths, *, cfg, steps, capacity):
        seen["steps"], seen["capacity"] = steps, capacity
        return np.zeros((steps, tokens.shape[0]), np.int32), np.zeros((steps, L, tokens.shape[0], HQ), np.int32)
    monkeypatch.setattr(ecal, "copy_run", copy_run)

    class Model:
        cfg, params, tokenizer, name = CFG, None, _bos_tokenizer(), "stub"

    windows = np.concatenate([np.zeros((1, 1), np.int32), np.arange(4, 67, dtype=np.int32)[None]], axis=1)
    calibrate(Model, windows, lengths=[64], depths=[0.1, 0.9])
    assert seen["steps"] == 5 and seen["capacity"] == 128
    for f in seen["fillers"]:
        np.testing.assert_array_equal(f, np.arange(4, 67))
