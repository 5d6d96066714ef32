"""STS: tile-wise top-k, the head-map calibration, STS-D/STS-P inside speculative decoding, multi-turn sessions."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jsparse import selection as sel
from jsparse.api import generate_ids
from jsparse.artifacts import ArtifactError, save_artifact
from jsparse.methods import make_method
from jsparse.methods.sts import STS, _scores, _topk_rows, _topk_set, empty_record, tile_head_topk
from jsparse.methods.sts_calibration import calibrate, load_head_map
from models.attention import LayerContext
from models.bundled import LoadedModel
from models.config import ModelConfig
from models.params import random_params
from pallas_kernels.sparse_attention.reference import masked_attention_reference
import itertools
from jsparse.methods.sts_calibration import _overlap, head_maps_from_overlap

CFG = ModelConfig(architecture="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512, eos_token_ids=(3,))
DRAFT_CFG = dataclasses.replace(CFG, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32)


@pytest.fixture(scope="module")
def pair():
    target = LoadedModel(cfg=CFG, params=random_params(CFG, jax.random.key(0), jnp.float32, scale=0.3),
                         tokenizer=None, name="target")
    draft = LoadedModel(cfg=DRAFT_CFG, params=random_params(DRAFT_CFG, jax.random.key(1), jnp.float32, scale=0.3),
                        tokenizer=None, name="draft")
    return target, draft


def test_tile_head_topk_matches_full_scores():
    B, T, Hq, Hkv, D, tile, W = 2, 37, 4, 2, 8, 8, 6
    q = jax.random.normal(jax.random.key(0), (B, T, Hq, D))
    k = jax.random.normal(jax.random.key(1), (B, T, Hkv, D))
    val, idx = tile_head_topk(q, k, tile, W)
    # The full [T, T] computation per query head: repeat K over the group, pool over tiles, keys before the tile.
    k_rep = jnp.repeat(k, Hq // Hkv, axis=2)
    probs = sel.before_tile_scores(sel.prefill_tile_probs(q, k_rep, tile), tile)  # [B, Hq, nT, T]
    ref_val, ref_idx = jax.lax.top_k(probs, W)
    ref_idx = np.where(np.isfinite(np.asarray(ref_val)), np.asarray(ref_idx), -1)
    np.testing.assert_array_equal(np.asarray(idx), ref_idx)
    assert np.all(np.asarray(idx)[:, :, 0] == -1)  # the first tile has no keys before it


def _windows(n=2, T=96, seed=0):
    return [np.asarray(jax.random.randint(jax.random.key(seed + i), (1, T), 4, CFG.vocab_size)) for i in range(n)]


def test_calibration_with_draft_equal_to_target_is_identity(pair):
    target, _ = pair
    art = calibrate(target.params, CFG, target.params, CFG, _windows(), ks=(8, 24), tile=16)
    maps = art.arrays["head_maps"]
    assert maps.shape == (2, CFG.num_layers, CFG.num_heads, 2)
    L, H = np.meshgrid(np.arange(CFG.num_layers), np.arange(CFG.num_heads), indexing="ij")
    for m in maps:
        np.testing.assert_array_equal(m[..., 0], L)
        np.testing.assert_array_equal(m[..., 1], H)
    assert art.meta["prompts"] == 2
    batched = calibrate(target.params, CFG, target.params, CFG, [np.concatenate(_windows())], ks=(8, 24), tile=16)
    assert batched.meta["prompts"] == 2  # prompts, not batches (it recorded 1 here)
    np.testing.assert_array_equal(batched.arrays["head_maps"], maps)


def test_artifact_keyed_to_both_models(pair, tmp_path):
    target, draft = pair
    art = calibrate(target.params, CFG, draft.params, DRAFT_CFG, _windows(1), ks=(8,), tile=16,
                    fingerprint="t" * 16, draft_fingerprint="d" * 16)
    assert art.arrays["head_maps"].shape == (1, CFG.num_layers, CFG.num_heads, 2)
    assert art.arrays["head_maps"][..., 0].max() < DRAFT_CFG.num_layers
    save_artifact(str(tmp_path), art)
    assert load_head_map(str(tmp_path), "t" * 16, "d" * 16, 8).shape == (CFG.num_layers, CFG.num_heads, 2)
    with pytest.raises(ArtifactError, match="model fingerprint 'tttttttttttttttt'"):
        load_head_map(str(tmp_path), "x" * 16, "d" * 16, 8)
    with pytest.raises(ArtifactError, match="draft fingerprint 'dddddddddddddddd'"):
        load_head_map(str(tmp_path), "t" * 16, "y" * 16, 8)
    with pytest.raises(ValueError, match="too short"):
        calibrate(target.params, CFG, draft.params, DRAFT_CFG, _windows(1, T=30), ks=(24,), tile=16)


def test_calibration_records_its_length_for_fractional_budgets(pair, tmp_path):
    """`calibrate` (not only the CLI) records the prompts' length: a fraction of it picks the map (without it the
    largest k stood in for the length, and budget 0.25 here read 6 tokens and picked k=8 instead of k=24)."""
    target, draft = pair
    art = calibrate(target.params, CFG, draft.params, DRAFT_CFG, _windows(1), ks=(8, 24), tile=16,
                    fingerprint="t" * 16, draft_fingerprint="d" * 16)
    assert art.meta["length"] == 96
    save_artifact(str(tmp_path), art)
    maps = art.arrays["head_maps"]
    np.testing.assert_array_equal(load_head_map(str(tmp_path), "t" * 16, "d" * 16, 0.25), maps[1])  # 24 tokens
    np.testing.assert_array_equal(load_head_map(str(tmp_path), "t" * 16, "d" * 16, 0.08), maps[0])  # 7.7 tokens
    with pytest.raises(ValueError, match="calibration prompts of 96 and 80 tokens: expected one length"):
        calibrate(target.params, CFG, draft.params, DRAFT_CFG, _windows(1) + _windows(1, T=80), ks=(8,), tile=16)


def test_sts_refuses_a_draft_other_than_the_one_its_head_map_was_calibrated_with(pair, tmp_path):
    """The artifact is checked against the draft when STS is built, and the draft it then runs with must be that
    one: another draft of the same shape (another layer-skipped copy, say) is refused, not run with a head map
    made for different heads."""
    import jsparse
    from jsparse.api import generate_ids
    from jsparse.artifacts import fingerprint
    from jsparse.session import Session

    target, draft = pair
    art = calibrate(target.params, CFG, draft.params, DRAFT_CFG, _windows(1), ks=(8,), tile=16,
                    fingerprint=fingerprint(target), draft_fingerprint=fingerprint(draft))
    save_artifact(str(tmp_path), art)
    sts = jsparse.build_method("sts", target, draft=draft, artifact=str(tmp_path), budget=0.5, min_tokens=4)
    assert sts.draft_fingerprint == fingerprint(draft)
    # The tile the overlaps were pooled with, unless given (the default 32 ran before).
    assert sts.tile == 16
    assert jsparse.build_method("sts", target, draft=draft, artifact=str(tmp_path), budget=0.5, min_tokens=4,
                                tile=32).tile == 32
    assert len(generate_ids(target, [[5, 6, 7, 8]], method=sts, draft=draft, gamma=2, max_new_tokens=3)[0]) == 3
    other = LoadedModel(cfg=DRAFT_CFG, params=random_params(DRAFT_CFG, jax.random.key(7), jnp.float32, scale=0.3),
                        tokenizer=None, name="other-draft")
    with pytest.raises(ValueError, match="head map was calibrated with the draft of fingerprint"):
        generate_ids(target, [[5, 6, 7, 8]], method=sts, draft=other, gamma=2, max_new_tokens=3)
    with pytest.raises(ValueError, match="head map was calibrated with the draft of fingerprint"):
        Session(target, other, method=sts, gamma=2)


def _head_map(cfg, dcfg):
    return np.stack(np.meshgrid(np.arange(cfg.num_layers) % dcfg.num_layers,
                                np.arange(cfg.num_heads) % dcfg.num_heads, indexing="ij"), axis=-1)


@pytest.mark.parametrize("gamma", [1, 3])
def test_full_budget_sts_equals_target_only_dense_greedy(pair, gamma):
    target, draft = pair
    sts = make_method("sts", cfg=CFG, draft=draft, head_map=_head_map(CFG, DRAFT_CFG), budget=1.0, tile=16)
    ids = [list(range(5, 45)), list(range(60, 83))]
    ref = generate_ids(target, ids, max_new_tokens=12)
    assert generate_ids(target, ids, method=sts, max_new_tokens=12, draft=draft, gamma=gamma) == ref


def test_sparse_budget_runs_and_errors(pair):
    target, draft = pair
    hm = _head_map(CFG, DRAFT_CFG)
    ids = [list(range(5, 85))]
    sts = make_method("sts", cfg=CFG, draft=draft, head_map=hm, budget=16, min_tokens=0, tile=16)
    stats = {}
    out = generate_ids(target, ids, method=sts, max_new_tokens=8, draft=draft, gamma=2, stats=stats)
    assert len(out[0]) >= 1 and all(0 <= t < CFG.vocab_size for t in out[0])
    assert 0.0 <= stats["acceptance_rate"] <= 1.0
    # A token budget above the cache (the request's 80 + 8 + 3 rows, rounded to 128) keeps every visible key, as
    # `--budget-tokens N` promises (k = min(N, visible keys)): the width is the capacity.
    from jsparse.methods.sts import static_k
    assert static_k(4096.0, 128, 0) == 128 and static_k(16.0, 128, 0) == 16
    big = make_method("sts", cfg=CFG, draft=draft, head_map=hm, budget=512)  # the model's context
    with pytest.raises(ValueError, match=r"budget=4096 tokens: more than the model's context of 512 tokens; expected "
                                         r"at most 512 \(budget=1.0 keeps every key\)"):
        make_method("sts", cfg=CFG, draft=draft, head_map=hm, budget=4096)  # no row ever sees that many keys
    dense = generate_ids(target, ids, max_new_tokens=8)
    assert generate_ids(target, ids, method=big, max_new_tokens=8, draft=draft, gamma=2) == dense  # greedy: exact
    with pytest.raises(ValueError, match="pass draft="):
        generate_ids(target, ids, method=sts, max_new_tokens=8)
    with pytest.raises(ValueError, match="head map has shape"):
        make_method("sts", cfg=CFG, draft=draft, head_map=hm[:2])
    with pytest.raises(ValueError, match="heads in \\[0, 2\\)"):
        make_method("sts", cfg=CFG, draft=draft, head_map=hm + 1)
    with pytest.raises(ValueError, match="needs a head map"):
        make_method("sts", cfg=CFG, draft=draft)
    with pytest.raises(ValueError, match="sts option slack=100: slack is set by the round's gamma"):
        make_method("sts", cfg=CFG, draft=draft, head_map=hm, slack=100)
    with pytest.raises(ValueError, match="carry=True: expected a decay in"):
        make_method("sts", cfg=CFG, draft=draft, head_map=hm, carry=True)
    carried = make_method("sts", cfg=CFG, draft=draft, head_map=hm, carry=np.float32(0.25))  # numpy scalars pass
    assert carried.carry == 0.25 and type(carried.carry) is float
    with pytest.raises(ValueError, match="budget=1.5"):
        make_method("sts", cfg=CFG, draft=draft, head_map=hm, budget=1.5)
    assert isinstance(sts, STS)


@pytest.mark.parametrize("options", [{}, {"first_step_mask": True, "mask_pool": 2}])
def test_sparse_sts_rows_do_not_depend_on_their_batch(options):
    """A row's tokens are the same alone and batched with a longer row (budget 0.3): the draft records each row's
    own budget (prefill: the tile's k, decode: the row's k + slack, the pool's share too), not the static width the
    batch's longest row or the cache capacity sets, and its prefill pools only the rows below its length. Before,
    the wider records entered the target's per-group sums and changed the keys it kept (tokens differed from the
    seventh on)."""
    cfg = dataclasses.replace(CFG, num_heads=8, num_kv_heads=4, max_position_embeddings=1024, eos_token_ids=())
    dcfg = dataclasses.replace(cfg, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)
    t = LoadedModel(cfg=cfg, params=random_params(cfg, jax.random.key(0), jnp.float32, scale=0.3), tokenizer=None,
                    name="t")
    d = LoadedModel(cfg=dcfg, params=random_params(dcfg, jax.random.key(1), jnp.float32, scale=0.3), tokenizer=None,
                    name="d")
    rng = np.random.default_rng(0)
    hm = np.stack([rng.integers(0, dcfg.num_layers, (cfg.num_layers, cfg.num_heads)),
                   rng.integers(0, dcfg.num_heads, (cfg.num_layers, cfg.num_heads))], -1).astype(np.int32)
    ids = [list(map(int, rng.integers(4, 128, n))) for n in (150, 61)]
    sts = make_method("sts", cfg=cfg, draft=d, head_map=hm, budget=0.3, min_tokens=8, tile=16, **options)
    both = generate_ids(t, ids, method=sts, draft=d, gamma=3, max_new_tokens=12)
    alone = generate_ids(t, ids[1:], method=sts, draft=d, gamma=3, max_new_tokens=12)
    assert both[1] == alone[0]


def test_three_turn_session_equals_dense(pair):
    """Full budget: every reply equals target-only dense greedy decoding of the whole conversation so far; the
    second message is short (gathered verification path), the third long (more than 32 new tokens). The later
    messages, of one 64-token bucket, share one compiled append (one per length before)."""
    from jsparse.session import Session
    from models.speculative import append_step

    target, draft = pair
    target = dataclasses.replace(target, cfg=dataclasses.replace(CFG, eos_token_ids=()))  # full-length replies
    method = make_method("sts", cfg=CFG, draft=draft, head_map=_head_map(CFG, DRAFT_CFG), budget=1.0, tile=16)
    session = Session(target, draft, method=method, gamma=3, capacity=256)
    history = []
    for turn, msg in enumerate((list(range(10, 50)), list(range(60, 70)), list(range(70, 105)))):
        if turn == 2:
            appends = append_step._cache_size()
        reply = session.send_ids(msg, max_new_tokens=10)
        assert len(reply) == 10
        ref = generate_ids(target, [history + msg], max_new_tokens=10)[0]
        assert reply == ref
        history += msg + reply
    assert append_step._cache_size() == appends
    assert session.tokens == history
    assert 0.0 <= session.acceptance_rate <= 1.0
    with pytest.raises(ValueError, match="more than the session's capacity of 256"):
        session.send_ids([4 + i % 100 for i in range(200)], max_new_tokens=10)


@pytest.mark.parametrize("selection", [None, "xla"])
def test_sts_decode_selects_the_mapped_draft_heads_top_k(selection):
    """STS-D on one layer: the draft's recorded rows (its T newest queries, pooled) -> per query head top-W ->
    head map -> summed over the GQA group -> top-K of the keys before the block, plus the block itself; the
    output equals masked attention over exactly those keys (numpy reference of the selection)."""
    from jsparse.methods.sts import StsDraft, empty_record
    from models.attention import LayerContext, LayerKV
    from pallas_kernels.sparse_attention.reference import masked_attention_reference

    B, Hq, Hkv, D, N, T, K = 2, 4, 2, 8, 48, 3, 6
    lengths = jnp.array([40, 29])
    q_d, q_t = (jax.random.normal(jax.random.key(i), (B, T, Hq, D)) for i in (0, 1))
    k, v = (jax.random.normal(jax.random.key(i), (B, Hkv, N, D)) for i in (2, 3))
    draft = StsDraft(budget=K, min_tokens=0, tile=16, slack=T, selection=selection)
    W = draft.decode_width(N)
    ctx = LayerContext(layer=jnp.int32(0), lengths=lengths)
    _, record = draft.decode(ctx, q_d, LayerKV(k=k, v=v), empty_record(1, B, Hq, 1, W))
    hm = np.array([[[0, 3], [0, 1], [0, 0], [0, 2]]], np.int32)  # target head h reads draft head hm[0, h, 1]
    sts = STS(head_map=jnp.asarray(hm), budget=K, min_tokens=0, tile=16, slack=T, draft_layers=1, draft_heads=Hq,
              selection=selection)
    out, _ = sts.decode(LayerContext(layer=jnp.int32(0), lengths=lengths, info=jnp.asarray(hm[0])), q_t,
                        LayerKV(k=k, v=v), record)
    # numpy reference
    qd, kk = np.asarray(q_d, np.float64), np.asarray(k, np.float64)
    mask = np.zeros((B, Hkv, T, N), bool)
    for b in range(B):
        L = int(lengths[b])
        n = L - T
        rows = {}
        for h in range(Hq):
            pooled = np.zeros(N)
            for t in range(T):
                logit = kk[b, h // 2, :n + t + 1] @ qd[b, t, h] / np.sqrt(D)
                p = np.exp(logit - logit.max())
                pooled[:n + t + 1] += p / p.sum()
            top = np.argsort(-pooled[:n + 1], kind="stable")[:W]  # the record: keys before the second new one
            rows[h] = {int(i): pooled[i] for i in top}
        for g in range(Hkv):
            score = {}
            for h in (2 * g, 2 * g + 1):
                for i, s in rows[hm[0, h, 1]].items():
                    if i < n:
                        score[i] = score.get(i, 0.0) + s
            chosen = sorted(score, key=lambda i: -score[i])[:K]
            for t in range(T):
                mask[b, g, t, chosen] = True
                mask[b, g, t, n: n + t + 1] = True
    ref = masked_attention_reference(q_t, k, v, jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5)


@pytest.mark.parametrize("path", ["per_layer", "rows", "blocks", "pool"])
def test_long_message_leaves_the_target_k_keys_before_it(path):
    """An appended message longer than the round (the draft's forward of T = M + 2 queries, [prev, tok, message],
    M > slack) whose own tokens draw most of the attention: the draft records only keys before the target's block
    (`record_limit`), so on every recording path the target still keeps K keys before the message, plus the
    message. Before, the record (K + slack wide) filled with the message's keys and left fewer than K."""
    from types import SimpleNamespace

    from jsparse.methods.sts import StsDraft, empty_record, record_limit
    from models.attention import LayerContext, LayerKV

    B, Hq, Hkv, D, N, K, slack, M = 2, 4, 2, 8, 64, 6, 3, 12
    T = M + 2
    lengths = jnp.array([50, 40])
    n = np.asarray(lengths) - (T - 1)  # the target appends [tok, message] from n
    base = jax.random.normal(jax.random.key(0), (D,))
    q = base + 0.1 * jax.random.normal(jax.random.key(1), (B, T, Hq, D))
    k, v = (jax.random.normal(jax.random.key(i), (B, Hkv, N, D)) for i in (2, 3))
    pos = jnp.arange(N)[None, None, :, None]
    new = (pos >= jnp.asarray(n)[:, None, None, None] - 1) & (pos < lengths[:, None, None, None])
    k = jnp.where(new, 3.0 * base, k)  # the forward's own keys dominate every query's weights
    draft = StsDraft(budget=K, min_tokens=0, slack=slack, first_step_mask=path == "pool", mask_pool=2,
                     record_after_scan=path in ("rows", "blocks"), record_selection="blocks" if path == "blocks"
                     else "rows", selection="xla")
    cfg = SimpleNamespace(num_heads=Hq, num_layers=1)
    state = draft.init_state(cfg, B, N)
    state = draft.start_rows(cfg, state, "decode", lengths, T, N)
    _, state = draft.decode(LayerContext(layer=jnp.int32(0), lengths=lengths), q, LayerKV(k=k, v=v), state)
    state = draft.finish(state, "decode")
    rec = np.asarray(state.pool_idx if path == "pool" else state.idx)
    limit = np.asarray(record_limit(lengths, T))
    np.testing.assert_array_equal(limit, n)
    for b in range(B):
        assert np.all(rec[:, b][rec[:, b] >= 0] < n[b])
        assert np.all(np.sum(rec[:, b] >= 0, axis=-1) == rec.shape[-1])  # full: n[b] >= W keys before
    hm = np.zeros((1, Hq, 2), np.int32)
    hm[0, :, 1] = np.arange(Hq)
    sts = STS(head_map=jnp.asarray(hm), budget=K, min_tokens=0, slack=slack, draft_layers=1, draft_heads=Hq,
              selection="xla", first_step_mask=path == "pool", mask_pool=2)
    keys = np.asarray(sts.decode_keys(sts.adopt_draft(None, state), jnp.asarray(hm[0]), lengths, T - 1, Hkv, N))
    for b in range(B):
        for g in range(Hkv):
            row = keys[b, g][keys[b, g] >= 0]
            assert np.sum(row < n[b]) == K, (b, g, row)
            np.testing.assert_array_equal(row[row >= n[b]], np.arange(n[b], lengths[b]))


@pytest.mark.parametrize("implementation", ["xla", "top_k"])
def test_draft_record_without_n_wide_masks_equals_the_masked_rule(implementation):
    """The draft's record (`add_recorded` + `_topk_visible`: carry added by a scatter, no -inf mask) keeps the
    keys and weights of the N-wide rule (`_scores` read as 0 where unrecorded, -inf past lengths, `_topk_set`),
    with rows shorter than W, zero weights below lengths and recorded keys past lengths."""
    from jsparse.methods.sts import _scores, _topk_set, _topk_visible, add_recorded
    B, H, N, W = 3, 4, 40, 8
    rng = np.random.default_rng(1)
    lengths = jnp.array([40, 23, 5])
    probs = rng.random((B, H, N)).astype(np.float32)
    probs[rng.random((B, H, N)) < 0.3] = 0.0  # zero weights below lengths tie with the keys past them
    probs = jnp.where(jnp.arange(N)[None, None] < lengths[:, None, None], probs, 0.0)
    idx = np.full((B, H, W), -1, np.int32)
    for b, h in np.ndindex(B, H):
        idx[b, h, :6] = np.sort(rng.choice(N, 6, replace=False))  # some past lengths: not added
    val = jnp.asarray(rng.random((B, H, W)), jnp.float32)
    idx = jnp.asarray(idx)
    old = _scores(idx, val, N, lengths)
    want = _topk_set(jnp.where(jnp.arange(N)[None, None] < lengths[:, None, None],
                               probs + 0.5 * jnp.where(jnp.isfinite(old), old, 0.0), -jnp.inf), W, implementation)
    got = _topk_visible(add_recorded(probs, idx, val, lengths, 0.5), lengths, W, implementation)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    assert int((got[1][2] >= 0).sum(-1).max()) == 5  # the 5-key row keeps its 5 keys, no key past its length


def test_row_merge_auto_takes_the_index_merge_for_few_candidates_only(monkeypatch):
    """row_merge="auto" (the default): the index merge while a group's candidates are at most 1/8 of the keys (budget
    512 at 32K-100K), the N-wide scatter above (budget 4096), as measured; "index" / "scatter" force one."""
    from jsparse.methods import sts as sts_module

    hm = jnp.zeros((2, 4, 2), jnp.int32)
    auto = STS(head_map=hm, budget=512.0, draft_layers=1, draft_heads=4, sink=4, local=60)
    assert auto.row_merge == "auto"
    assert auto.merge_kind(4 * 520, 100_000) == "index" and auto.merge_kind(4 * 520, 32_768) == "index"
    assert auto.merge_kind(4 * 4104, 100_000) == "scatter" and auto.merge_kind(4 * 4104, 32_768) == "scatter"
    assert auto.merge_kind(1000, 8 * 1064) == "index" and auto.merge_kind(1000, 8 * 1064 - 1) == "scatter"
    assert auto.replace(row_merge="index").merge_kind(4 * 4104, 32_768) == "index"
    assert auto.replace(row_merge="scatter").merge_kind(8, 100_000) == "scatter"
    called = []
    monkeypatch.setattr(sts_module, "merge_rows", lambda *a, **kw: called.append("index"))
    monkeypatch.setattr(sts_module, "merge_rows_reference", lambda *a: called.append("scatter"))
    idx = jnp.zeros((1, 2, 8), jnp.int32)
    auto._merge(idx, idx.astype(jnp.float32), 1000, None, 4, 4)
    auto._merge(idx, idx.astype(jnp.float32), 500, None, 4, 4)
    assert called == ["index", "scatter"]


@pytest.mark.parametrize("row_merge", ["index", "scatter"])
def test_start_rows_takes_every_layers_keys_as_each_layer_alone(row_merge):
    """`STS.start_rows` selects every sparse layer's keys in one batch before the layer scan; each layer's keys
    and its attention output equal those of the layer selecting alone (`decode_keys` with its own head-map row),
    and `finish` drops them (the state keeps its structure across steps)."""
    import types
    from jsparse.methods.sts import DraftRecord
    from models.attention import LayerContext, LayerKV

    B, Hq, Hkv, D, N, T, K, Ld, Lt, W = 2, 4, 2, 8, 64, 3, 6, 2, 4, 9
    rng = np.random.default_rng(0)
    idx = np.full((Ld, B, Hq, 1, W), -1, np.int32)
    for l, b, h in np.ndindex(Ld, B, Hq):
        idx[l, b, h, 0, : W - 1] = np.sort(rng.choice(50, W - 1, replace=False))  # one padding slot
    record = DraftRecord(idx=jnp.asarray(idx), val=jnp.asarray(rng.random(idx.shape), jnp.float32))
    hm = np.stack([rng.integers(0, Ld, (Lt, Hq)), rng.integers(0, Hq, (Lt, Hq))], -1).astype(np.int32)
    sts = STS(head_map=jnp.asarray(hm), budget=K, min_tokens=0, tile=16, slack=T, draft_layers=Ld, draft_heads=Hq,
              dense_layers=1, row_merge=row_merge)
    cfg = types.SimpleNamespace(num_layers=Lt, num_kv_heads=Hkv)
    lengths = jnp.array([57, 40])
    state = sts.start_rows(cfg, record, "decode", lengths, T, N)
    assert state.chosen.shape == (Lt - 1, B, Hkv, K + T)
    q = jax.random.normal(jax.random.key(0), (B, T, Hq, D))
    k, v = (jax.random.normal(jax.random.key(i), (B, Hkv, N, D)) for i in (1, 2))
    for layer in range(1, Lt):
        alone = sts.decode_keys(record, jnp.asarray(hm[layer]), lengths, T, Hkv, N)
        np.testing.assert_array_equal(np.asarray(state.chosen[layer - 1]), np.asarray(alone))
        ctx = LayerContext(layer=jnp.int32(layer), lengths=lengths, info=jnp.asarray(hm[layer]))
        got, _ = sts.decode(ctx, q, LayerKV(k=k, v=v), state)
        want, _ = sts.decode(ctx, q, LayerKV(k=k, v=v), record)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert sts.finish(state, "decode").chosen is None
    assert sts.start_rows(cfg, record, "prefill", lengths, T, N).chosen is None


@pytest.mark.parametrize("implementation", ["xla", "top_k"])
def test_topk_set_records_the_keys_of_lax_top_k(implementation):
    """The draft's decode record by topk_select: the same (key, weight) pairs as lax.top_k's rank-ordered rows
    (ties, -inf keys, rows with fewer than W choosable keys), positions ascending, -1 / -inf padded."""
    B, H, N, W = 3, 4, 300, 37
    x = jax.random.uniform(jax.random.key(0), (B, H, N))
    x = jnp.where(jnp.arange(H)[None, :, None] % 2 == 0, jnp.round(x * 8) / 8, x)  # many ties in even rows
    lengths = jnp.array([300, 120, 20])  # the last row has fewer than W choosable keys
    scores = jnp.where(jnp.arange(N)[None, None, :] < lengths[:, None, None], x, -jnp.inf)
    val, idx = _topk_set(scores, W, implementation)
    ref_val, ref_idx = _topk_rows(scores, W)
    val, idx, ref_val, ref_idx = map(np.asarray, (val, idx, ref_val, ref_idx))
    assert idx.shape == ref_idx.shape == (B, H, W)
    for b in range(B):
        for h in range(H):
            got = idx[b, h][idx[b, h] >= 0]
            assert np.all(np.diff(got) > 0)  # ascending
            assert np.all(idx[b, h][len(got):] == -1) and np.all(val[b, h][len(got):] == -np.inf)
            ref = ref_idx[b, h] >= 0
            assert dict(zip(got.tolist(), val[b, h][:len(got)].tolist())) == \
                dict(zip(ref_idx[b, h][ref].tolist(), ref_val[b, h][ref].tolist()))
    assert (idx[2] >= 0).sum(axis=-1).tolist() == [20] * H


@pytest.mark.parametrize("implementation", ["xla", "top_k"])
def test_target_selection_equals_lax_top_k_selection(implementation):
    """The target's top-k over the summed draft rows: topk_select on the new (ascending) record equals
    sel.topk_indices (lax.top_k) on the old (rank-ordered) record, per-row budgets and the limit included."""
    from pallas_kernels.topk_select import topk_select

    B, H, G, N, W, K = 2, 3, 4, 500, 40, 48
    probs = jax.random.uniform(jax.random.key(1), (B, H * G, N))
    probs = jnp.round(probs * 64) / 64  # ties in the pooled weights and their sums
    limit = jnp.array([450, 90])
    masked = jnp.where(jnp.arange(N)[None, None, :] < limit[:, None, None] + 5, probs, -jnp.inf)
    old_val, old_idx = _topk_rows(masked, W)
    new_val, new_idx = _topk_set(masked, W, implementation)
    group = lambda x: x.reshape(B, H, G * W)  # noqa: E731
    old_scores = _scores(group(old_idx), group(old_val), N, limit)
    new_scores = _scores(group(new_idx), group(new_val), N, limit)
    np.testing.assert_allclose(np.asarray(new_scores), np.asarray(old_scores), rtol=1e-6)
    k_dyn = jnp.array([[40], [30]])
    old = sel.topk_indices(old_scores, k_dyn, K)
    new = topk_select(new_scores, k_dyn, K, implementation=implementation)
    np.testing.assert_array_equal(np.asarray(new), np.asarray(old))
    assert (np.asarray(new)[0] >= 0).sum(axis=-1).tolist() == [40] * H


def test_sparse_generation_same_with_xla_selection(pair):
    """STS-P and STS-D end to end at a sparse budget: the sort-free "xla" selection gives the tokens of lax.top_k."""
    target, draft = pair
    hm = _head_map(CFG, DRAFT_CFG)
    ids = [list(range(5, 85)), list(range(20, 70))]
    out = {}
    for selection in (None, "xla"):
        sts = make_method("sts", cfg=CFG, draft=draft, head_map=hm, budget=16, min_tokens=0, tile=16,
                          selection=selection)
        assert sts.selection == selection
        out[selection] = generate_ids(target, ids, method=sts, max_new_tokens=8, draft=draft, gamma=2)
    assert out["xla"] == out[None]
    with pytest.raises(ValueError, match="selection='sort'"):
        make_method("sts", cfg=CFG, draft=draft, head_map=hm, selection="sort")


def test_sts_forced_sink_and_local_keys():
    """`sink` and `local` keep the first keys and the keys just below the limit (inside the budget); no others."""
    import jax.numpy as jnp

    from jsparse.methods.sts import _scores

    idx = jnp.asarray([[[5, 1, -1]]], jnp.int32)  # [B=1, H=1, C=3]: draft keys 5 and 1
    val = jnp.asarray([[[0.5, 0.25, 0.0]]], jnp.float32)
    s = np.asarray(_scores(idx, val, 16, jnp.asarray([12]), sink=2, local=3))[0, 0]
    assert np.isposinf(s[[0, 1]]).all()  # the sinks first, then the window, its newest key first
    assert np.isfinite(s[[9, 10, 11]]).all() and 1e6 < s[9] < s[10] < s[11]
    assert s[5] == 0.5 and np.isneginf(s[[2, 3, 4, 6, 7, 8, 12, 13, 14, 15]]).all()
    plain = np.asarray(_scores(idx, val, 16, jnp.asarray([12])))[0, 0]
    assert plain[1] == 0.25 and plain[5] == 0.5 and np.isneginf(np.delete(plain, [1, 5])).all()
    # A budget below sink + local keeps the sinks and the newest keys of the window (it kept the window's oldest).
    from jsparse.methods.sts import merge_rows, merge_rows_reference

    for merge in (lambda *a: merge_rows(*a[:1], a[1], *a[3:]), merge_rows_reference):
        got = merge(idx, val, 16, jnp.asarray([12]), 4, 4, 2, 3)
        assert np.asarray(got).tolist() == [[[0, 1, 10, 11]]]


def test_sts_option_errors():
    from jsparse.methods.sts import STS

    with pytest.raises(ValueError, match="local=-1"):
        STS(local=-1)
    from jsparse.methods.sts import check_budget

    for bad in (float("nan"), float("inf"), 0.0, -2.0):  # NaN built and failed at generation; inf overflowed there
        with pytest.raises(ValueError, match=r"budget=.*: expected a fraction of the context in \(0, 1\] or a "):
            check_budget(bad)
    with pytest.raises(ValueError, match="mask_attention='no'"):
        STS(mask_attention="no")
    with pytest.raises(ValueError, match="dense_layers=3"):
        cfg = type("C", (), {"num_layers": 2, "num_heads": 2, "num_kv_heads": 1})()
        draft = type("D", (), {"cfg": cfg})()
        STS.build(cfg=cfg, draft=draft, head_map=np.zeros((2, 2, 2), np.int32), dense_layers=3)


def test_a_head_map_naming_draft_layers_or_heads_it_lacks_is_refused(pair):
    """The head map indexes the draft's record: an entry outside [0, L_d) x [0, Hq_d) is refused by `build` and by
    a direct `STS(head_map=...)` alike, naming the range, and a map of floats too; inside a trace it is not checked."""
    target, draft = pair
    good = np.zeros((CFG.num_layers, CFG.num_heads, 2), np.int32)
    layer, head = good.copy(), good.copy()
    layer[1, 2, 0] = DRAFT_CFG.num_layers  # one past the draft's last layer
    head[0, 0, 1] = -1
    for hm, match in ((layer, r"draft layers 0..2 and heads 0..0: expected layers in \[0, 2\) and heads in \[0, 2\)"),
                      (head, r"heads -1..0")):
        with pytest.raises(ValueError, match=match):
            STS.build(cfg=CFG, draft=draft, head_map=hm)
        with pytest.raises(ValueError, match=match):
            STS(head_map=jnp.asarray(hm), draft_layers=DRAFT_CFG.num_layers, draft_heads=DRAFT_CFG.num_heads)
    with pytest.raises(ValueError, match="dtype float32: expected integers"):
        STS(head_map=good.astype(np.float32), draft_layers=2, draft_heads=2)
    ok = STS(head_map=jnp.asarray(good), draft_layers=2, draft_heads=2)
    assert jax.jit(lambda m: m.head_map.sum())(ok) == 0  # rebuilt around tracers inside jit: no check there


def test_sts_draft_carry_pools_the_steps():
    """carry = 0 keeps the last step's weights alone; carry > 0 adds the decayed earlier record."""
    from types import SimpleNamespace

    from jsparse.methods.sts import StsDraft, empty_record

    B, Hq, Hkv, N, D = 1, 2, 1, 16, 8
    key = jax.random.key(0)
    k = jax.random.normal(key, (B, Hkv, N, D))
    cache = SimpleNamespace(k=k, v=k)
    q = jax.random.normal(jax.random.key(1), (B, 1, Hq, D))
    ctx = SimpleNamespace(layer=0, lengths=jnp.asarray([12]))
    rec = empty_record(1, B, Hq, 1, 12)
    rec = rec.replace(idx=rec.idx.at[0, 0, 0, 0, 0].set(3), val=rec.val.at[0, 0, 0, 0, 0].set(5.0))
    _, plain = StsDraft(budget=12, min_tokens=0, slack=0, carry=0.0).decode(ctx, q, cache, rec)
    _, pooled = StsDraft(budget=12, min_tokens=0, slack=0, carry=0.5).decode(ctx, q, cache, rec)
    v0 = dict(zip(np.asarray(plain.idx[0, 0, 0, 0]), np.asarray(plain.val[0, 0, 0, 0])))
    v1 = dict(zip(np.asarray(pooled.idx[0, 0, 0, 0]), np.asarray(pooled.val[0, 0, 0, 0])))
    np.testing.assert_allclose(v1[3], v0[3] + 2.5, rtol=1e-6)
    np.testing.assert_allclose([v1[j] for j in v0 if j != 3], [v0[j] for j in v0 if j != 3], rtol=1e-6)
    with pytest.raises(ValueError, match="carry=2"):
        STS(carry=2.0)
    assert StsDraft().carry == STS().carry == 0.5  # the default (measured; the paper's is 0)


def _random_rows(seed, B, H, G, W, N, limit, dyadic):
    """G draft rows per KV head side by side [B, H, G * W]: each a set of distinct keys in [0, N) (rank order,
    some -1 padding), weights dyadic (exact sums, many ties) or random floats."""
    rng = np.random.default_rng(seed)
    idx = np.full((B, H, G, W), -1, np.int32)
    for b in range(B):
        for h in range(H):
            for g in range(G):
                m = int(rng.integers(0, W + 1))  # entries in this row; the rest -1
                pool = max(int(limit[b]) + 3, m)  # some keys at or past the limit (dropped)
                idx[b, h, g, :m] = rng.choice(min(pool, N), size=min(m, min(pool, N)), replace=False)
    val = rng.integers(0, 8, idx.shape) / 8.0 if dyadic else rng.random(idx.shape)
    val = np.where(idx >= 0, val, -np.inf).astype(np.float32)
    return jnp.asarray(idx.reshape(B, H, G * W)), jnp.asarray(val.reshape(B, H, G * W))


@pytest.mark.parametrize("implementation,sink,local,dyadic", [
    ("top_k", 0, 0, True), ("top_k", 0, 0, False), ("top_k", 3, 0, True), ("top_k", 0, 5, False),
    ("top_k", 4, 6, True), ("top_k", 4, 6, False), ("xla", 4, 6, True)])
def test_merge_rows_selects_the_keys_of_the_scatter_reference(implementation, sink, local, dyadic):
    """The index-level union of a group's draft rows (`merge_rows`) chooses exactly the keys of the N-wide path
    (`merge_rows_reference`): duplicates across rows summed, ties to the lower key, -1 padding, keys past the
    limit dropped, budgets above the candidate count, forced sink/local keys (overlapping when the limit is
    small), per-row budgets, and the prefill's scalar limit; with a static bound (the packed one-key sort) and with
    a bound too large to pack (the three-operand sort) alike."""
    from jsparse.methods.sts import merge_rows, merge_rows_reference

    B, H, G, W, N = 3, 2, 4, 6, 64
    limit = jnp.array([40, 7, 0])  # row 2: nothing below the limit
    idx, val = _random_rows(sink * 10 + local + dyadic, B, H, G, W, N, limit, dyadic)
    for bound in (None, N, 2 ** 30):  # 2^30: (bound + 1) * entries >= 2^31, not packed
        for k, K in ((jnp.array([[5], [3], [4]]), 8), (jnp.array([[30], [30], [30]]), 48), (2, 2)):
            got = merge_rows(idx, val, limit, k, K, sink, local, implementation, bound=bound)
            ref = merge_rows_reference(idx, val, N, limit, k, K, sink, local, implementation)
            assert got.shape == ref.shape == (B, H, K)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
        got = merge_rows(idx, val, jnp.int32(20), 6, 10, sink, local, implementation, bound=bound)  # a tile's start
        ref = merge_rows_reference(idx, val, N, jnp.int32(20), 6, 10, sink, local, implementation)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
        assert np.all(np.asarray(got)[2] >= -1)


def test_merge_rows_sums_duplicates_and_breaks_ties_low():
    from jsparse.methods.sts import merge_rows

    idx = jnp.asarray([[[9, 4, 2, -1, 4, 9, 7, 2]]], jnp.int32)  # two rows of 4: keys 9, 4, 2 repeat
    val = jnp.asarray([[[0.25, 0.5, 0.5, -jnp.inf, 0.25, 0.25, 1.0, 0.5]]], jnp.float32)
    # sums: 9 -> 0.5, 4 -> 0.75, 2 -> 1.0, 7 -> 1.0: the top 2 are 2 and 7 (1.0); top 3 adds 4; key 9 is past 9
    assert np.asarray(merge_rows(idx, val, jnp.asarray([10]), 2, 4)).tolist() == [[[2, 7, -1, -1]]]
    assert np.asarray(merge_rows(idx, val, jnp.asarray([10]), 3, 3)).tolist() == [[[2, 4, 7]]]
    assert np.asarray(merge_rows(idx, val, jnp.asarray([7]), 8, 8)).tolist() == [[[2, 4] + [-1] * 6]]
    # a tie between the sums of 2 and 7 goes to the lower key; sink keys 0, 1 are forced first
    assert np.asarray(merge_rows(idx, val, jnp.asarray([10]), 3, 3, sink=2)).tolist() == [[[0, 1, 2]]]
    for bound in (10, 16):  # the packed sort: the same
        assert np.asarray(merge_rows(idx, val, jnp.asarray([10]), 3, 3, bound=bound)).tolist() == [[[2, 4, 7]]]
        assert np.asarray(merge_rows(idx, val, jnp.asarray([10]), 3, 3, sink=2, bound=bound)).tolist() == [[[0, 1, 2]]]


def test_row_merge_option_same_generation(pair):
    """STS-P and STS-D end to end at a sparse budget with sink/local: the index-level merge gives the tokens of the
    N-wide scatter path."""
    target, draft = pair
    hm = _head_map(CFG, DRAFT_CFG)
    ids = [list(range(5, 85)), list(range(20, 70))]
    out = {}
    for row_merge in ("index", "scatter"):
        sts = make_method("sts", cfg=CFG, draft=draft, head_map=hm, budget=16, min_tokens=0, tile=16, sink=2,
                          local=4, row_merge=row_merge)
        out[row_merge] = generate_ids(target, ids, method=sts, max_new_tokens=8, draft=draft, gamma=2)
    assert out["index"] == out["scatter"]
    with pytest.raises(ValueError, match="row_merge='dense'"):
        make_method("sts", cfg=CFG, draft=draft, head_map=hm, row_merge="dense")
    with pytest.raises(ValueError, match="first_step_mask='yes'"):
        make_method("sts", cfg=CFG, draft=draft, head_map=hm, first_step_mask="yes")
    with pytest.raises(ValueError, match="mask_pool=0"):
        make_method("sts", cfg=CFG, draft=draft, head_map=hm, first_step_mask=True, mask_pool=0)
    with pytest.raises(ValueError, match="record_after_scan='no'"):
        make_method("sts", cfg=CFG, draft=draft, head_map=hm, record_after_scan="no")


@pytest.mark.parametrize("gamma,mask_pool,mask_attention", [(3, 1, True), (3, 2, True), (3, 2, False)])
def test_first_step_mask_full_budget_equals_target_only_dense_greedy(pair, gamma, mask_pool, mask_attention):
    target, draft = pair
    sts = make_method("sts", cfg=CFG, draft=draft, head_map=_head_map(CFG, DRAFT_CFG), budget=1.0, tile=16,
                      first_step_mask=True, mask_pool=mask_pool, mask_attention=mask_attention)
    d_method = sts.for_round(DRAFT_CFG, gamma)[1]
    assert sts.first_step_mask and d_method.first_step_mask and d_method.mask_pool == mask_pool
    assert d_method.mask_attention == mask_attention
    ids = [list(range(5, 45)), list(range(60, 83))]
    ref = generate_ids(target, ids, max_new_tokens=12)
    assert generate_ids(target, ids, method=sts, max_new_tokens=12, draft=draft, gamma=gamma) == ref


def _draft_round(first_step_mask, budget, carry, seed=0, mask_pool=1, mask_attention=True):
    """One draft layer through a round's first step (T = 2) and two later steps (T = 1) on a random cache.
    Returns (states after each step, outputs of the later steps, q of the later steps, k, v, lengths, W, gamma);
    with `first_step_mask` the states' records are read through `pool_record` (what the target adopts)."""
    from jsparse.methods.sts import StsDraft, empty_record
    from models.attention import LayerContext, LayerKV

    B, Hq, Hkv, D, N, gamma = 2, 4, 2, 8, 64, 3
    lengths = jnp.array([41, 23])  # after the first step (T = 2)
    keys = jax.random.split(jax.random.key(seed), 6)
    k, v = (jax.random.normal(keys[i], (B, Hkv, N, D)) for i in (0, 1))
    draft = StsDraft(budget=budget, min_tokens=0, tile=16, slack=gamma, carry=carry, first_step_mask=first_step_mask,
                     mask_pool=mask_pool, mask_attention=mask_attention)
    W = draft.decode_width(N)
    rec = empty_record(1, B, Hq, 1, W, draft.pool_width(N))
    records, outs, qs = [], [], []
    for step, T in enumerate((2, 1, 1)):
        q = jax.random.normal(keys[2 + step], (B, T, Hq, D))
        ctx = LayerContext(layer=jnp.int32(0), lengths=lengths + step)
        out, rec = draft.decode(ctx, q, LayerKV(k=k, v=v), rec)
        records.append(rec)
        outs.append(out)
        qs.append(q)
    return records, outs, qs, k, v, lengths, W, gamma


@pytest.mark.parametrize("carry,mask_pool", [(0.0, 1), (0.5, 1), (0.5, 2)])
def test_first_step_mask_record_matches_reference(carry, mask_pool):
    """Small budget: the first step keeps a pool S of its top P = mask_pool * W keys; a later draft step attends,
    per query head, to S plus the last gamma keys (softmax over that set), the pool keeps S with weights
    carry * old + p, and the record the target adopts is the top W of S by that weight (numpy)."""
    from jsparse.methods.sts import pool_record

    states, outs, qs, k, v, lengths, W, gamma = _draft_round(True, 6, carry, mask_pool=mask_pool)
    first = states[0]
    S = np.asarray(first.pool_idx[0])  # [B, Hq, P]
    P = S.shape[-1]
    assert P == min(mask_pool * W, k.shape[2])
    # a full pool: the first step's top P of the keys before the round (`record_limit`: below lengths - 1)
    np.testing.assert_array_equal((S >= 0).sum(axis=-1),
                                  np.broadcast_to(np.minimum(P, np.asarray(lengths) - 1)[:, None], S.shape[:2]))
    kk, vv = np.asarray(k, np.float64), np.asarray(v, np.float64)
    B, Hq, D = S.shape[0], S.shape[1], kk.shape[-1]
    old = np.asarray(first.pool_val[0], np.float64)
    for step in (1, 2):
        st = states[step]
        np.testing.assert_array_equal(np.asarray(st.pool_idx[0]), S)  # the keys stay S
        q = np.asarray(qs[step], np.float64)
        new = np.zeros_like(old)
        for b in range(B):
            L = int(lengths[b]) + step
            for h in range(Hq):
                keys = sorted(set(S[b, h][S[b, h] >= 0].tolist()) | set(range(L - gamma, L)))
                logit = kk[b, h // 2, keys] @ q[b, 0, h] / np.sqrt(D)
                p = np.exp(logit - logit.max())
                p /= p.sum()
                np.testing.assert_allclose(np.asarray(outs[step])[b, 0, h], p @ vv[b, h // 2, keys], atol=1e-5)
                weight = dict(zip(keys, p))
                new[b, h] = [weight[i] + carry * old[b, h, j] if i >= 0 else old[b, h, j]
                             for j, i in enumerate(S[b, h])]
        np.testing.assert_allclose(np.asarray(st.pool_val[0]), new, rtol=1e-5, atol=1e-7)
        rec = pool_record(st)  # what the target adopts: the top W of the pool by pooled weight
        assert rec.pool_idx is None and rec.idx.shape == (1, B, Hq, 1, W)
        for b in range(B):
            for h in range(Hq):
                slots = [j for j in range(P) if S[b, h, j] >= 0]
                best = sorted(slots, key=lambda j: (-new[b, h, j], S[b, h, j]))[:W]
                got = np.asarray(rec.idx[0, b, h, 0])
                np.testing.assert_array_equal(got[got >= 0], np.sort(S[b, h, best]))
                np.testing.assert_allclose(np.asarray(rec.val[0, b, h, 0])[got >= 0],
                                           [new[b, h, j] for j in sorted(best, key=lambda j: S[b, h, j])],
                                           rtol=1e-5, atol=1e-7)
        old = new


def test_first_step_mask_pool_first_step_record_is_the_dense_steps():
    """After the round's first step the record the target adopts from a pool of 2 W keys is the default draft's
    first-step record (the top W of the same weights)."""
    from jsparse.methods.sts import pool_record

    masked = _draft_round(True, 6, 0.5, mask_pool=2)[0][0]
    dense = _draft_round(False, 6, 0.5)[0][0]
    assert masked.pool_idx.shape[-1] == 2 * dense.idx.shape[-1]
    rec = pool_record(masked)
    np.testing.assert_array_equal(np.asarray(rec.idx), np.asarray(dense.idx))
    np.testing.assert_allclose(np.asarray(rec.val), np.asarray(dense.val), rtol=1e-6)


def test_first_step_mask_full_budget_record_and_output_equal_dense_steps():
    """Full budget: the first step records every key before the round (its [prev, tok] from n - 1: keys below n),
    so the later steps' attention (that pool plus the round's new keys) is dense attention and their record holds
    today's weights on every key before the round."""
    from jsparse.methods.sts import pool_record

    masked = _draft_round(True, 1.0, 0.5)
    dense = _draft_round(False, 1.0, 0.5)
    lengths = masked[5]
    for step in (1, 2):
        np.testing.assert_allclose(np.asarray(masked[1][step]), np.asarray(dense[1][step]), atol=1e-5)
        for b in range(2):
            first_len = int(lengths[b]) - 1  # n: the round's first new key
            m_rec = pool_record(masked[0][step])
            m_idx, m_val = np.asarray(m_rec.idx[0, b, :, 0]), np.asarray(m_rec.val[0, b, :, 0])
            d_idx, d_val = np.asarray(dense[0][step].idx[0, b, :, 0]), np.asarray(dense[0][step].val[0, b, :, 0])
            for h in range(m_idx.shape[0]):
                np.testing.assert_array_equal(m_idx[h][m_idx[h] >= 0], np.arange(first_len))
                d = dict(zip(d_idx[h].tolist(), d_val[h].tolist()))
                np.testing.assert_allclose(m_val[h][:first_len], [d[i] for i in range(first_len)], rtol=1e-5)


def test_pool_record_with_dense_later_attention():
    """`mask_attention=False`: the later draft steps attend over the whole cache (outputs equal the dense steps'),
    and the pool is re-weighted with each pool key's weight in that full softmax (numpy reference), h = carry * h
    + p; at full budget the adopted record holds the dense steps' record of the keys before the round.""" 
    from jsparse.methods.sts import pool_record

    carry = 0.5
    pooled = _draft_round(True, 6, carry, mask_pool=2, mask_attention=False)
    dense = _draft_round(False, 6, carry)
    records, outs, qs, k, v, lengths, W, gamma = pooled
    kk, D = np.asarray(k, np.float64), k.shape[-1]
    for step in (1, 2):
        np.testing.assert_allclose(np.asarray(outs[step]), np.asarray(dense[1][step]), atol=1e-5)
        before, after = records[step - 1], records[step]
        np.testing.assert_array_equal(np.asarray(after.pool_idx), np.asarray(before.pool_idx))  # keys kept
        q = np.asarray(qs[step], np.float64)
        for b in range(2):
            n = int(lengths[b]) + step  # keys visible to this step's query
            for h in range(4):
                logits = kk[b, h // 2, :n] @ q[b, 0, h] / np.sqrt(D)
                p = np.exp(logits - logits.max())
                p /= p.sum()
                idx = np.asarray(before.pool_idx[0, b, h])
                old = np.asarray(before.pool_val[0, b, h])
                ok = idx >= 0
                want = p[idx[ok]] + carry * old[ok]
                np.testing.assert_allclose(np.asarray(after.pool_val[0, b, h])[ok], want, rtol=1e-5, atol=1e-7)
    full = _draft_round(True, 1.0, carry, mask_attention=False)
    full_dense = _draft_round(False, 1.0, carry)
    for step in (1, 2):
        np.testing.assert_allclose(np.asarray(full[1][step]), np.asarray(full_dense[1][step]), atol=1e-5)
        got, want = pool_record(full[0][step]), full_dense[0][step]
        for b in range(2):  # the keys before the round (the target takes the round's new tokens itself)
            first = int(lengths[b]) - 1  # n: the round's first new key
            g_idx, w_idx = np.asarray(got.idx[0, b, :, 0]), np.asarray(want.idx[0, b, :, 0])
            g_val, w_val = np.asarray(got.val[0, b, :, 0]), np.asarray(want.val[0, b, :, 0])
            for h in range(4):
                g, w = (g_idx[h] >= 0) & (g_idx[h] < first), (w_idx[h] >= 0) & (w_idx[h] < first)
                np.testing.assert_array_equal(g_idx[h][g], w_idx[h][w])
                np.testing.assert_allclose(g_val[h][g], w_val[h][w], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("first_step_mask,mask_pool,mask_attention,carry,record_selection", [
    (False, 1, True, 0.0, "rows"), (True, 2, False, 0.5, "rows"),  # every value of each option once
    (False, 1, True, 0.5, "blocks"), (False, 1, True, 0.0, "blocks"), (True, 2, False, 0.5, "blocks")])
def test_record_after_scan_equals_the_per_layer_record(first_step_mask, mask_pool, mask_attention, carry,
                                                       record_selection):
    """The model's decode with `record_after_scan` (every layer's weight rows selected at once after the layer
    scan, over whole rows or by blocks: `record_selection`) leaves the same record / pool, the same logits and no
    buffer in the state, step after step, as the per-layer selection inside the scan; rows of different lengths,
    3 draft layers, one- and two-query steps."""
    from jsparse.methods.sts import StsDraft
    from models import llama
    from models.cache import init_cache

    cfg = dataclasses.replace(CFG, num_layers=3)
    params = random_params(cfg, jax.random.key(3), jnp.float32, scale=0.3)
    B, N, T0 = 2, 96, 40
    tokens = jax.random.randint(jax.random.key(4), (B, T0), 0, cfg.vocab_size)
    lengths = jnp.array([40, 27])
    runs = []
    for after in (True, False):
        draft = StsDraft(budget=6, min_tokens=0, slack=3, carry=carry, first_step_mask=first_step_mask,
                         mask_pool=mask_pool, mask_attention=mask_attention, record_after_scan=after,
                         record_selection=record_selection)
        state = draft.init_state(cfg, B, N)
        _, cache, _ = llama.prefill(params, cfg, make_method("dense"), tokens, lengths, init_cache(cfg, B, N, jnp.float32),
                                    None)
        seen = []
        decode = jax.jit(lambda c, s, t: llama.decode(params, cfg, draft, t, c, s))  # compiled once per T
        for step, T in enumerate((2, 1, 1, 2, 1)):
            new = jax.random.randint(jax.random.key(10 + step), (B, T), 0, cfg.vocab_size)
            logits, cache, state = decode(cache, state, new)
            assert state.weights is None and state.lengths is None and state.bmax is None and state.lse is None
            seen.append((logits, state))
        runs.append(seen)
    for (l1, s1), (l2, s2) in zip(*runs):
        tol = 1e-6 if jax.default_backend() == "cpu" else 2e-5  # a GPU's fusions round differently (H200: 8e-6)
        np.testing.assert_allclose(np.asarray(l1), np.asarray(l2), rtol=tol, atol=tol)
        for name in ("idx", "pool_idx"):
            if getattr(s1, name) is not None:
                np.testing.assert_array_equal(np.asarray(getattr(s1, name)), np.asarray(getattr(s2, name)))
        # By blocks a one-query step's weights are exp(logit - lse) of the logits it records, the per-layer path's a
        # softmax: the same up to float rounding.
        # (An H200's fusions add up to 1.2e-5 on the blocks' weights.)
        rtol = (1e-5 if jax.default_backend() == "cpu" else 5e-5) if record_selection == "blocks" else 1e-6
        for name in ("val", "pool_val"):
            if getattr(s1, name) is not None:
                np.testing.assert_allclose(np.asarray(getattr(s1, name)), np.asarray(getattr(s2, name)), rtol=rtol)
    held = runs[0][-1][1]
    assert int(np.sum(np.asarray(held.pool_idx if first_step_mask else held.idx) >= 0)) > 0


@pytest.mark.parametrize("carry", [0.0, 0.5])
def test_select_by_blocks_keeps_the_keys_of_the_row_selection(carry):
    """`select_by_blocks` (the draft record's top W from block maxima and the W best blocks' keys) keeps exactly the
    keys and weights of `StsDraft._select` over whole rows: from weights, and from scaled logits with their
    log-sum-exp (garbage past lengths, as the kernel leaves it); ties, zero weights, short rows, recorded keys."""
    from jsparse.methods.sts import StsDraft, select_by_blocks
    from pallas_kernels.dense_decode.reference import block_max

    rng = np.random.default_rng(0)
    shapes = [(397, 29, 16), (61, 3, 4), (200, 17, 8), (130, 30, 16)]  # (N, W, block): four, each compiled once
    for trial in range(12):
        (N, W, block), B, R = shapes[trial // 3], 3, 5  # each shape with ties, most with zeros too
        lengths = jnp.array([N, rng.integers(1, N), rng.integers(1, 12)], jnp.int32)
        x = rng.standard_normal((B, R, N)).astype(np.float32) * 3
        x = jnp.asarray(np.round(x) if trial % 3 == 0 else x)  # many ties in every third trial
        visible = jnp.arange(N)[None, None] < lengths[:, None, None]
        lse = jax.nn.logsumexp(jnp.where(visible, x, -jnp.inf), axis=-1)
        p = jnp.where(visible, jnp.exp(x - lse[..., None]), 0.0)
        zeros = trial % 4 == 1
        if zeros:  # zero weights below lengths tie with the keys past them
            p = jnp.where(jnp.asarray(rng.random((B, R, N)) < 0.5), 0.0, p)
        rec_idx = np.full((B, R, W), -1, np.int32)
        for b, r in np.ndindex(B, R):
            n = int(rng.integers(0, W + 1))
            rec_idx[b, r, :n] = np.sort(rng.choice(N, n, replace=False))  # some past lengths: not added
        rec_idx, rec_val = jnp.asarray(rec_idx), jnp.asarray(rng.random((B, R, W)), jnp.float32)
        want = StsDraft(carry=carry, selection="top_k")._select(p, rec_idx, rec_val, lengths)
        got = select_by_blocks(p, block_max(p, lengths, block), rec_idx, rec_val, lengths, carry, None, "xla", block)
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
        if not zeros:
            garbage = jnp.where(visible, x, jnp.nan)
            got = select_by_blocks(garbage, block_max(x, lengths, block), rec_idx, rec_val, lengths, carry, lse,
                                   "top_k", block)
            np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
            np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-6)


def test_record_selection_option():
    """record_selection="auto" selects by blocks in one-query steps while W blocks of keys are at most 16384 and half
    the cache (budget 512 at 32K-100K; not budget 4096, nor a `mask_pool` of 4 at 100K, nor the round's two-query
    first step); a bad value is an error naming it."""
    from jsparse.methods.sts import StsDraft

    auto = StsDraft()
    assert auto.record_by_blocks(520, 100_000) and auto.record_by_blocks(520, 32_768)
    assert not auto.record_by_blocks(520, 100_000, q_len=2) and StsDraft(record_selection="blocks").record_by_blocks(
        520, 100_000, q_len=2)
    assert not auto.record_by_blocks(4104, 100_000) and not auto.record_by_blocks(4 * 520, 100_000)
    assert not auto.record_by_blocks(520, 16_000)
    assert StsDraft(record_selection="blocks").record_by_blocks(4104, 100)
    assert not StsDraft(record_selection="rows").record_by_blocks(520, 100_000)
    hm = jnp.zeros((2, 4, 2), jnp.int32)
    with pytest.raises(ValueError, match="record_selection='fast'"):
        STS(head_map=hm, draft_layers=1, draft_heads=4, record_selection="fast")


def test_layer_dense_layers_is_sparse_and_the_one_before_dense():
    """STS(dense_layers=d): layers 0..d-1 attend densely in prefill and layer d is already sparse. With an empty draft
    record (no recorded key) a sparse layer's query sees only its own causal tile, so its output differs from full
    causal attention; layer d - 1's equals it (the masked dense reference, causal)."""
    rng = np.random.default_rng(0)
    L, B, T, Hq, Hkv, D, tile = 3, 1, 16, 2, 1, 8, 4
    q = rng.standard_normal((B, T, Hq, D)).astype(np.float32)
    k = rng.standard_normal((B, T, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((B, T, Hkv, D)).astype(np.float32)
    head_map = jnp.zeros((L, Hq, 2), jnp.int32)
    m = STS(head_map=head_map, draft_layers=1, draft_heads=Hq, budget=0.25, min_tokens=0, tile=tile, dense_layers=1)
    state = empty_record(1, B, Hq, T // tile, 4)  # nothing recorded
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, Hq, T, T))
    head_major = lambda x: jnp.asarray(x).transpose(0, 2, 1, 3)  # noqa: E731 - [B, Hkv, T, D], as the reference reads
    dense = np.asarray(masked_attention_reference(jnp.asarray(q), head_major(k), head_major(v), causal), np.float64)
    lengths = jnp.asarray([T], jnp.int32)
    outs = {}
    for layer in (0, 1):
        ctx = LayerContext(layer=jnp.int32(layer), lengths=lengths, info=head_map[layer])
        out, _ = m.prefill(ctx, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), state)
        outs[layer] = np.asarray(out, np.float64)
    np.testing.assert_allclose(outs[0], dense, rtol=1e-4, atol=1e-5)  # layer 0 < dense_layers: dense
    # layer 1 == dense_layers: sparse; its queries past the first tile miss the keys before their tile
    assert np.abs(outs[1][:, tile:] - dense[:, tile:]).max() > 1e-2
    np.testing.assert_allclose(outs[1][:, :tile], dense[:, :tile], rtol=1e-4, atol=1e-5)  # first tile: all it sees


def _pooled_np(q, k, tile, lengths):
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    nT = -(-T // tile)
    out = np.zeros((B, Hq, nT, T))
    for b in range(B):
        for h in range(Hq):
            kk = k[b, :, h // G].astype(np.float64)
            for i in range(nT):
                s = i * tile
                for t in range(s, min(s + tile, T)):
                    if t >= lengths[b]:
                        continue
                    x = kk[:t + 1] @ q[b, t, h].astype(np.float64) / math.sqrt(D)
                    p = np.exp(x - x.max())
                    p /= p.sum()
                    out[b, h, i, :t + 1] += p
    return out


def test_padding_rows_add_nothing_to_the_pooled_weights():
    """sts.tile_head_topk with lengths: the query rows at or past a row's length (right padding) add nothing to the
    tile-pooled weights. Checked against numpy: per query head and query tile starting at s, the causal softmax
    weights of the tile's rows t < lengths[b], summed over those rows, over the keys j < s; the top W of them."""
    rng = np.random.default_rng(0)
    B, T, Hq, Hkv, D, tile, W = 2, 12, 2, 1, 8, 4, 3
    q = rng.standard_normal((B, T, Hq, D)).astype(np.float32)
    k = rng.standard_normal((B, T, Hkv, D)).astype(np.float32)
    lengths = np.asarray([10, 12], np.int32)  # row 0: positions 10, 11 are padding (inside its last tile)
    val, idx = tile_head_topk(jnp.asarray(q), jnp.asarray(k), tile, W, jnp.asarray(lengths))
    val, idx = np.asarray(val), np.asarray(idx)
    pooled = _pooled_np(q, k, tile, lengths)
    for b in range(B):
        for h in range(Hq):
            for i in range(-(-T // tile)):
                s = i * tile
                n_keys = min(W, s)
                assert (idx[b, h, i] >= 0).sum() == n_keys
                if not n_keys:
                    continue
                want = np.sort(pooled[b, h, i, :s])[::-1][:n_keys]
                np.testing.assert_allclose(val[b, h, i, :n_keys], want, rtol=1e-4, atol=1e-6)
                # the indices hold those weights
                np.testing.assert_allclose(pooled[b, h, i, idx[b, h, i, :n_keys]], want, rtol=1e-4, atol=1e-6)


def test_sts_by_name_with_a_draft_is_built_with_that_draft(pair):
    """method="sts" with draft= builds STS with the draft (refused only for its missing head map), not as if no
    draft were given."""
    target, draft = pair
    for call in (lambda: generate_ids(target, [[5, 6, 7]], method="sts", draft=draft, gamma=2, max_new_tokens=2),
                 lambda: __import__("jsparse").Session(target, draft, method="sts", gamma=2)):
        with pytest.raises(ValueError, match="method 'sts' needs a head map: --artifact DIR"):
            call()


def test_pool_record_takes_each_rows_own_pool_keys():
    """The target reads the top pool_keys[b] keys of each pool row by pooled weight (ties to the lower position),
    ascending, -1 padded: a row whose own budget is below the record's width W does not take W keys."""
    from jsparse.methods.sts import DraftRecord, pool_record

    W = 4
    pool_idx = np.array([[[[2, 5, 7, 9, 11, 14]], [[0, 1, 3, 4, 6, -1]]]], np.int32)  # [L=1, B=2, H=1, P=6]
    pool_val = np.array([[[[0.1, 0.5, 0.3, 0.5, 0.2, 0.05]], [[0.4, 0.1, 0.3, 0.2, 0.6, 0.0]]]], np.float32)
    keys = np.array([3, 4], np.int32)
    rec = DraftRecord(idx=jnp.full((1, 2, 1, 1, W), -1, jnp.int32), val=jnp.zeros((1, 2, 1, 1, W), jnp.float32),
                      pool_idx=jnp.asarray(pool_idx), pool_val=jnp.asarray(pool_val), pool_keys=jnp.asarray(keys))
    got = pool_record(rec)
    for b in range(2):
        entries = [(-float(v), int(i)) for i, v in zip(pool_idx[0, b, 0], pool_val[0, b, 0]) if i >= 0]
        top = sorted(i for _, i in sorted(entries)[: keys[b]])
        want = top + [-1] * (W - len(top))
        np.testing.assert_array_equal(np.asarray(got.idx)[0, b, 0, 0], want)
        wv = [float(pool_val[0, b, 0][list(pool_idx[0, b, 0]).index(i)]) if i >= 0 else 0.0 for i in want]
        np.testing.assert_allclose(np.asarray(got.val)[0, b, 0, 0], wv)


def test_carry_one_is_a_valid_decay():
    """carry is a decay in [0, 1] (docstring and error message): 1.0, the undecayed sum of the round's steps, is
    accepted by STS and handed to the round's draft; just above it is refused naming the value."""
    from jsparse.methods.sts import STS

    assert STS(carry=1.0).carry == 1.0 and STS(carry=0.0).carry == 0.0
    target_m, draft_m = STS(carry=1.0, draft_layers=DRAFT_CFG.num_layers,
                            draft_heads=DRAFT_CFG.num_heads).for_round(DRAFT_CFG, 2)
    assert target_m.carry == 1.0 and draft_m.carry == 1.0
    with pytest.raises(ValueError, match=r"carry=1.0001: expected a decay in \[0, 1\]"):
        STS(carry=1.0001)


def test_decode_width_is_the_budget_plus_the_rounds_slack():
    """The draft records per decode row the budget's k at the capacity plus `slack` (the round's new keys, which the
    target drops from the draft's choice), at most the capacity; `for_round` sets slack to gamma (at least 1)."""
    from jsparse.methods.sts import STS, StsDraft, static_k

    assert StsDraft(budget=16, min_tokens=0, slack=3).decode_width(128) == 16 + 3
    assert StsDraft(budget=0.25, min_tokens=0, slack=2).decode_width(128) == static_k(0.25, 128, 0) + 2 == 34
    assert StsDraft(budget=16, min_tokens=0, slack=3).decode_width(18) == 18  # capped at the capacity
    sts = STS(budget=16, min_tokens=0, draft_layers=DRAFT_CFG.num_layers, draft_heads=DRAFT_CFG.num_heads)
    for gamma, slack in ((3, 3), (1, 1), (0, 1)):
        target_m, draft_m = sts.for_round(DRAFT_CFG, gamma)
        assert target_m.slack == draft_m.slack == slack
        assert draft_m.decode_width(128) == target_m.decode_width(128) == 16 + slack
        assert draft_m.init_state(DRAFT_CFG, 1, 128).idx.shape[-1] == 16 + slack


def test_head_map_of_picks_the_k_nearest_in_ratio():
    """`load_head_map`: the map calibrated at the k nearest the budget in ratio, |log(k / tokens)| (a fraction taken
    of the calibration length), not in absolute difference: 14 tokens lie nearer 24 than 8 in ratio (24/14 < 14/8)
    though nearer 8 in tokens."""
    from jsparse.artifacts import Artifact
    from jsparse.methods.sts import head_map_of

    ks = np.asarray([8, 24, 96])
    maps = np.stack([np.full((CFG.num_layers, CFG.num_heads, 2), i, np.int32) for i in range(3)])
    art = Artifact(kind="sts", fingerprint="t" * 16, arrays={"ks": ks, "head_maps": maps},
                   meta={"draft_fingerprint": "d" * 16, "length": 96})
    for budget, want in ((14, 1), (13, 0), (40, 1), (50, 2), (14 / 96, 1), (0.6, 2), (1, 2)):
        got = head_map_of(art, "art", "d" * 16, budget)
        np.testing.assert_array_equal(got, maps[want])


def test_pool_keys_are_the_rows_own_budget_plus_slack_not_the_pools():
    """With first_step_mask and mask_pool = 2, the first step pools mask_pool * (k + slack) keys per row but records
    as pool_keys the row's own k + slack (k: the budget at the keys it may record, below lengths - 1), at most the
    record's width W: the target reads that many keys from the pool (`pool_record`), not the pool's share."""
    from jsparse.methods.sts import budget_k, pool_record

    states, _, _, k, _, lengths, W, gamma = _draft_round(True, 0.25, 0.5, mask_pool=2)
    first = states[0]
    limits = np.asarray(lengths) - 1  # `record_limit` of the round's first step (T = 2)
    want = [min(int(budget_k(0.25, int(n), 0)) + gamma, W, int(n)) for n in limits]
    assert want[0] < W and want[1] < W  # the rows' own widths, below the static one
    assert (np.asarray(first.pool_idx[0]) >= 0).sum(axis=-1).tolist() == [[min(2 * w, n)] * 4 for w, n in
                                                                          zip(want, limits)]
    np.testing.assert_array_equal(np.asarray(first.pool_keys), want)
    for st in states:  # the later steps keep the first step's pool_keys
        rec = pool_record(st)
        np.testing.assert_array_equal((np.asarray(rec.idx[0, :, :, 0]) >= 0).sum(axis=-1),
                                      np.broadcast_to(np.asarray(want)[:, None], (2, 4)))


def test_overlap_counts_shared_top_k_keys_over_the_tiles_past_k():
    """`_overlap` against its definition in Python sets: for each k, overlap[k][target head, draft head] = the sum
    over traces and over the tiles with more than k keys before them (start > k) of |first k of I_t ∩ first k of
    I_d| (rank order, -1 padded), and the head map takes its argmax as (draft layer, draft head)."""
    rng = np.random.default_rng(0)
    Lt, Ht, Ld, Hd, B, tile, nT, kmax = 2, 2, 3, 2, 2, 4, 5, 8
    T, ks = tile * nT, (4, 8)  # tile starts 0, 4, 8, 12, 16: k=4 counts the tiles at 8, 12, 16 (not 4); k=8 12, 16

    def ranked(L, H):
        idx = np.full((L, B, H, nT, kmax), -1, np.int64)
        for l, b, h, i in np.ndindex(L, B, H, nT):
            n = min(i * tile, kmax)
            idx[l, b, h, i, :n] = rng.choice(max(i * tile, 1), n, replace=False) if n else []
        return idx

    t_idx, d_idx = ranked(Lt, Ht), ranked(Ld, Hd)
    got = np.asarray(_overlap(jnp.asarray(t_idx, jnp.int32), jnp.asarray(d_idx, jnp.int32), ks, tile, T))
    want = np.zeros((len(ks), Lt * Ht, Ld * Hd))
    for n_k, k in enumerate(ks):
        for (lt, ht), (ld, hd) in itertools.product(np.ndindex(Lt, Ht), np.ndindex(Ld, Hd)):
            for b, i in np.ndindex(B, nT):
                if i * tile > k:
                    a = {int(x) for x in t_idx[lt, b, ht, i, :k] if x >= 0}
                    c = {int(x) for x in d_idx[ld, b, hd, i, :k] if x >= 0}
                    want[n_k, lt * Ht + ht, ld * Hd + hd] += len(a & c)
    np.testing.assert_array_equal(got, want)
    assert not np.array_equal(want[0], want[1])  # the maps of the two k differ in what they count
    maps = head_maps_from_overlap(want.reshape(len(ks), Lt, Ht, Ld, Hd), Hd)
    for n_k, lt, ht in np.ndindex(len(ks), Lt, Ht):
        flat = want[n_k, lt * Ht + ht]
        best = int(np.flatnonzero(flat == flat.max())[0])
        assert tuple(maps[n_k, lt, ht]) == (best // Hd, best % Hd)


def test_identity_overlap_is_k_per_eligible_tile(pair):
    """Draft = target: a head's own top-k overlaps itself in all k keys of every tile with more than k keys before
    it, so overlap[k][l, h, l, h] = k * (prompts) * (tiles starting past k): T=96, tile=16 (starts 0..80) gives 5
    tiles for k=8 and 4 for k=24."""
    target, _ = pair
    art = calibrate(target.params, CFG, target.params, CFG, [np.concatenate(_windows())], ks=(8, 24), tile=16)
    ov = art.arrays["overlap"].reshape(2, CFG.num_layers * CFG.num_heads, -1)
    np.testing.assert_array_equal(np.diagonal(ov, axis1=1, axis2=2), [[2 * 5 * 8] * 12, [2 * 4 * 24] * 12])


def test_calibration_argument_errors(pair):
    """Refused before any trace: a draft of another vocabulary, a k below 1, prompts of k + tile tokens or fewer."""
    target, draft = pair
    other = dataclasses.replace(DRAFT_CFG, vocab_size=64)
    with pytest.raises(ValueError, match="draft vocabulary of 64 tokens differs from the target's 128"):
        calibrate(target.params, CFG, draft.params, other, _windows(1), ks=(8,), tile=16)
    with pytest.raises(ValueError, match=r"k=\[0, 8\]: expected one or more token counts >= 1"):
        calibrate(target.params, CFG, draft.params, DRAFT_CFG, _windows(1), ks=(8, 0), tile=16)
    with pytest.raises(ValueError, match="calibration prompts of 40 tokens are too short for k=24 with tile=16: "
                                         "expected more than k \\+ tile = 40 tokens"):
        calibrate(target.params, CFG, draft.params, DRAFT_CFG, _windows(1, T=40), ks=(24, 8), tile=16)


def test_dense_step_pool_weights_are_the_softmax_weights_of_visible_keys_only():
    """The later draft step's pooling weights: each key of idx weighs exp(q.k / sqrt(D) - lse) in its row's dense
    softmax over the keys below the length, and padding (-1) and keys at or past the length weigh 0 (their K rows
    hold values no query sees; a mutant dropping `idx < lengths` gave them weight); the output is the dense
    attention, in float64 by hand."""
    from jsparse.methods.sts import dense_step_pool_weights
    from models.attention import LayerKV
    rng = np.random.default_rng(3)
    B, Hq, Hkv, N, D = 2, 4, 2, 16, 8
    q = rng.normal(size=(B, 1, Hq, D)).astype(np.float32)
    k, v = (rng.normal(size=(B, Hkv, N, D)).astype(np.float32) for _ in range(2))
    lengths = np.array([16, 9])
    idx = np.broadcast_to(np.array([0, 3, 8, 12, 15, -1]), (B, Hq, 6)).astype(np.int32)  # 12 and 15 past row 1's 9
    out, p = dense_step_pool_weights(jnp.asarray(q), LayerKV(k=jnp.asarray(k), v=jnp.asarray(v)), jnp.asarray(lengths),
                                     jnp.asarray(idx))
    for b, h in itertools.product(range(B), range(Hq)):
        n = lengths[b]
        s = k[b, h // 2, :n].astype(np.float64) @ q[b, 0, h] / math.sqrt(D)
        w = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
        want = [w[i] if 0 <= i < n else 0.0 for i in idx[b, h]]
        np.testing.assert_allclose(np.asarray(p[b, h]), want, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(np.asarray(out[b, 0, h]), w @ v[b, h // 2, :n], rtol=1e-5, atol=1e-6)
    assert (np.asarray(p[1, :, 3:]) == 0).all() and (np.asarray(p[0, :, 3:5]) > 0).all()
