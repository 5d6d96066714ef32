"""STS speculative decoding vs dense on Llama-3.1-8B-shaped target + Llama-3.2-1B-shaped draft (random weights).

Per (context, batch) cell, in one process (dense measured in the same run):
  * target-only dense decode step (T = 1) and the dense verification step (T = gamma + 1);
  * per budget: the STS verification step with the target's union of draft rows done by the N-wide scatter
    (`STS(row_merge="scatter")`, the path before issue 23's index-level merge) and at index level
    (`row_merge="index"`, `jsparse.methods.sts.merge_rows`);
  * the draft's own steps: dense (no record), STS's round-opening step (T = 2: dense + a top-W per layer and head
    over the cache; its default `record_selection`, and "rows": the whole-row selection before 2026-12-01), STS's
    later step with dense attention + top-W (the paper's; both selections) and with `first_step_mask`
    (attention through the first step's record plus the round's new keys, no top-W);
    and with `first_step_mask` and a pool of `mask_pool` p * W keys (POOLS; the first step takes the top p * W);
  * whole rounds (gamma draft steps + verification, `models.speculative.round_step`, caches donated) for dense
    speculative decoding and for STS (ROUND_VARIANTS): "old" (scatter merge, dense draft steps), "index"
    (index-level merge, dense draft steps), "index+rows" (the same with `record_selection="rows"`), "index+blocks" (with
    "blocks": the round's two-query first step by blocks too), "index+mask"
    (index-level merge, `first_step_mask`),
    "index+mask_poolP" (the same with `mask_pool` P), "index+densemask_poolP" (the pool with
    `mask_attention=False`: dense later draft steps, the record limited to the pool). A round does the same work
    whatever the accepted length a (the forward shapes are fixed), so each round is timed once (a forced to
    ACCEPT, default 3) and tokens/s = B * (a + 1) / round time is reported for a = 0 .. gamma.
Bytes floors: weights + KV bytes read per step. Writes JSON to $OUT/$JSON (default sts_bench.json) and prints a table.

Caches hold random normal values (`cache`). Run it with XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 (batch 3 at 100K needs
about 68 GB: weights 18.5 GB, target cache 39.6 GB, draft cache 9.9 GB).
Environment: CELLS="32768:1,100000:2" (context:batch list; the default), BUDGETS="512,4096", ROUND_BUDGETS="512"
(budgets whose rounds are timed), QUEUED=1 (each time the mean of calls dispatched back to back, one wait at the end,
as the library's jitted loops run them; default: the median of calls each waited for), ACCEPT=3, POOLS="2,4" (the `mask_pool` values), ROUND_VARIANTS (default
"index,index+mask" and "index+mask_poolP" for each pool; "old" only when named), SMOKE=1 (tiny shapes: a CPU
check of the script), AT_LAYER (variant names, e.g. "index,index+densemask_pool4", also timed as "NAME@layer" with
the draft's top-W per layer inside the layer scan, `record_after_scan=False`: the first step, the later dense step and
the round when named in ROUND_VARIANTS), LAYOUT (the weights' layout, `models.params.with_layout`: default = fused q/k/v and gate/up
on a GPU since 2026-11-28, fused or separate), DRAFT_DENSE_CONFIG (the dense decode kernel's config at the draft's
head_dim, e.g. "block_k=64,num_stages=4,target_programs=1024"; default: the kernel's), GIT_COMMIT (recorded).
GPU: `OUT=... GIT_COMMIT=$(git rev-parse --short HEAD) python eval/results/h100/sts_bench/bench_sts.py`.
"""
import dataclasses, json, os, time, datetime, traceback
import numpy as np
import jax, jax.numpy as jnp

from eval.bench.model import filled_cache
from jsparse.methods.base import make_method
from jsparse.methods.sts import STS, DraftRecord
from models import llama
from models.params import fuse_by_default, random_params, with_layout
from models.presets import preset
from models.speculative import SpecState, round_step
from models.compile_options import model_jit

T_CFG = preset("llama3-8b")
D_CFG = dataclasses.replace(T_CFG, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                            num_kv_heads=8, head_dim=64, tie_word_embeddings=True)
GAMMA = 4
SMOKE = bool(os.environ.get("SMOKE"))
if SMOKE:  # a CPU check of the script on tiny shapes
    T_CFG = dataclasses.replace(T_CFG, vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                                num_heads=4, num_kv_heads=2, head_dim=16)
    D_CFG = dataclasses.replace(T_CFG, num_layers=1)
BF = jnp.bfloat16
ACCEPT = int(os.environ.get("ACCEPT", 3))
POOLS = [int(x) for x in os.environ.get("POOLS", "2,4").split(",") if x]  # `mask_pool` values measured
ROUND_VARIANTS = os.environ.get("ROUND_VARIANTS", "index,index+mask," + ",".join(f"index+mask_pool{p}" for p in POOLS))
ROUND_SET = set(ROUND_VARIANTS.split(","))  # the round variants timed (whole names)
LAYOUT = os.environ.get("LAYOUT", "default")
AT_LAYER = [x for x in os.environ.get("AT_LAYER", "").split(",") if x]  # variants also timed with record_after_scan=False
if os.environ.get("DRAFT_DENSE_CONFIG"):  # e.g. "block_k=64,num_stages=4,target_programs=1024": the dense decode
    # kernel's config at the draft's head_dim (`pallas_kernels.dense_decode.api.CONFIGS`; the target's is unchanged)
    from pallas_kernels.dense_decode import api as _dd_api
    from pallas_kernels.dense_decode.gpu import DenseDecodeConfig
    _dd_api.CONFIGS[D_CFG.head_dim] = DenseDecodeConfig(**{k: int(v) for k, v in (
        kv.split("=") for kv in os.environ["DRAFT_DENSE_CONFIG"].split(","))})


def make_params(cfg, key):
    """Random bf16 weights of `cfg` in LAYOUT."""
    return with_layout(random_params(cfg, key, BF), LAYOUT, donate=True)


QUEUED = bool(os.environ.get("QUEUED"))  # time n calls dispatched back to back, one wait at the end


def timeit(fn, carry, n=5, warm=2):
    """fn(carry) -> carry (donated buffers threaded through); median ms of n calls after warm-up, each waited for;
    with QUEUED the mean of n calls dispatched back to back with one wait at the end (as the library's jitted
    generation loops run steps and rounds: no host round trip between them)."""
    for _ in range(warm):
        carry = jax.block_until_ready(fn(carry))
    if QUEUED:
        t = time.perf_counter()
        for _ in range(n):
            carry = fn(carry)
        carry = jax.block_until_ready(carry)
        return (time.perf_counter() - t) / n * 1e3, carry
    ts = []
    for _ in range(n):
        t = time.perf_counter(); carry = jax.block_until_ready(fn(carry)); ts.append(time.perf_counter() - t)
    return float(np.median(ts)) * 1e3, carry


def cache(cfg, B, N, n, seed=0):
    """Stacked caches of random normal bf16 keys and values (`eval.bench.model.filled_cache`). Random values, not
    a constant: with equal keys every score ties, which is the worst case of the exact top-k selections (the
    measurements before 2026-11-25 used a constant fill)."""
    return filled_cache(cfg, B, n, N, BF, seed=seed)


def param_bytes(p):
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(p))


def ints(name, default):
    return [int(x) for x in os.environ.get(name, default).split(",") if x]


def with_pool(rng, rec, P, n):
    """The record plus a random pool of P keys per layer, row and head (the draft state of `first_step_mask`)."""
    pool = random_record(rng, D_CFG, rec.idx.shape[1], P, n)
    return rec.replace(pool_idx=pool.idx[:, :, :, 0], pool_val=pool.val[:, :, :, 0])


def random_record(rng, cfg, B, W, n):
    """A full draft record (W distinct keys below n per layer, row and head, ascending) with random weights."""
    L, H = cfg.num_layers, cfg.num_heads
    idx = np.sort(np.argsort(rng.random((L, B, H, 1, n)), axis=-1)[..., :W], axis=-1) if n <= 4096 else \
        np.sort(rng.choice(n, size=(L, B, H, 1, W), replace=True), axis=-1)  # duplicates: harmless for timing
    return DraftRecord(idx=jnp.asarray(idx, jnp.int32), val=jnp.asarray(rng.random(idx.shape), jnp.float32))


def dump(out, recs, wb_t, wb_d):
    """Writes the JSON (after every row, so a run cut short keeps what it measured)."""
    json.dump(dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                   date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   commit=os.environ.get("GIT_COMMIT", ""),
                   command="python eval/results/h100/sts_bench/bench_sts.py (env: CELLS=%s BUDGETS=%s "
                           "ROUND_BUDGETS=%s ACCEPT=%d POOLS=%s ROUND_VARIANTS=%s)" % (
                               os.environ.get("CELLS", ""), os.environ.get("BUDGETS", ""),
                               os.environ.get("ROUND_BUDGETS", ""), ACCEPT, os.environ.get("POOLS", ""),
                               ROUND_VARIANTS) + (" DRAFT_DENSE_CONFIG=" + os.environ["DRAFT_DENSE_CONFIG"]
                                                  if os.environ.get("DRAFT_DENSE_CONFIG") else ""),
                   target="llama3-8b shapes", draft="llama3.2-1b shapes", dtype="bfloat16", gamma=GAMMA,
                   accepted_timed=ACCEPT, smoke=SMOKE, layout=LAYOUT,
                   timing="queued (mean of calls dispatched back to back)" if QUEUED else "waited (median of calls)",
                   fused_projections=LAYOUT == "fused" or (LAYOUT == "default" and fuse_by_default()),
                   weights_bytes=dict(target=wb_t, draft=wb_d), records=recs),
              open(os.path.join(out, os.environ.get("JSON", "sts_bench.json")), "w"), indent=1)


def main():
    out = os.environ.get("OUT", "/tmp")
    tp = make_params(T_CFG, jax.random.key(0))
    dp = make_params(D_CFG, jax.random.key(1))
    wb_t, wb_d = param_bytes(tp), param_bytes(dp)
    kv_tok_t = 2 * T_CFG.num_layers * T_CFG.num_kv_heads * T_CFG.head_dim * 2
    kv_tok_d = 2 * D_CFG.num_layers * D_CFG.num_kv_heads * D_CFG.head_dim * 2
    rng = np.random.default_rng(0)
    head_map = np.stack([rng.integers(0, D_CFG.num_layers, (T_CFG.num_layers, T_CFG.num_heads)),
                         rng.integers(0, D_CFG.num_heads, (T_CFG.num_layers, T_CFG.num_heads))], -1).astype(np.int32)
    dense = make_method("dense")
    cells = os.environ.get("CELLS", "1024:1,1024:2" if SMOKE else "32768:1,100000:2")
    cells = [tuple(int(x) for x in c.split(":")) for c in cells.split(",")]
    budgets = ints("BUDGETS", "128,256" if SMOKE else "512,4096")
    round_budgets = ints("ROUND_BUDGETS", "128" if SMOKE else "512")
    recs = []
    dec = model_jit(lambda p, m, t, c, st: llama.decode(p, T_CFG, m, t, c, st)[1], donate_argnums=(3,))
    ddec = model_jit(lambda p, m, t, c, st: llama.decode(p, D_CFG, m, t, c, st)[1:], donate_argnums=(3, 4))
    for ctx, B in cells:
        n, cap = ctx, ctx + 640
        try:
            tc, dc = cache(T_CFG, B, cap, n), cache(D_CFG, B, cap, n)
            tok = jnp.ones((B,), jnp.int32)
            t_dense_step, tc = timeit(lambda c: dec(tp, dense, tok[:, None], c, None), tc)
            toks = jnp.ones((B, GAMMA + 1), jnp.int32)
            t_ver_dense, tc = timeit(lambda c: dec(tp, dense, toks, c, None), tc)
            dstate = (dc, None)
            t_draft_dense, dstate = timeit(lambda c: ddec(dp, dense, tok[:, None], *c), dstate)
            dc = dstate[0]
            row0 = dict(context=ctx, batch=B, gamma=GAMMA, target_dense_step_ms=t_dense_step,
                        verify_dense_ms=t_ver_dense, draft_dense_step_ms=t_draft_dense,
                        dense_decode_tokens_per_s=B / t_dense_step * 1e3)
            s = SpecState(target=tc, draft=dc, t_state=None, d_state=None, tok=tok + 0, prev=tok + 0)  # donated
            limit = jnp.full((B,), GAMMA + 1, jnp.int32)
            key = jax.random.key(0)
            fa = jnp.full((B,), ACCEPT, jnp.int32)

            def round_ms(s, tm, dm, t_state, d_state):
                s = s.replace(t_state=t_state, d_state=d_state)
                fn = lambda st: round_step(tp, dp, tm, dm, st, key, limit, t_cfg=T_CFG, d_cfg=D_CFG, gamma=GAMMA,
                                           forced_accept=fa)[0]
                return timeit(fn, s, n=3, warm=1)

            ms, s = round_ms(s, dense, dense, None, None)
            row0["dense_spec_round_ms"] = ms
            for budget in budgets:
                row = dict(row0, budget_tokens=budget)
                base = STS(head_map=jnp.asarray(head_map), budget=float(budget), draft_layers=D_CFG.num_layers,
                           draft_heads=D_CFG.num_heads, row_merge="index")  # labelled "index" below ("auto": either)
                variants = {"old": base.replace(row_merge="scatter"), "index": base,
                            "index+rows": base.replace(record_selection="rows"),
                            "index+blocks": base.replace(record_selection="blocks"),
                            "index+mask": base.replace(first_step_mask=True)}
                variants.update({f"index+mask_pool{p}": base.replace(first_step_mask=True, mask_pool=p)
                                 for p in POOLS})
                variants.update({f"index+densemask_pool{p}": base.replace(first_step_mask=True, mask_pool=p,
                                                                          mask_attention=False) for p in POOLS})
                # "NAME@layer": the same with the draft's top-W per layer inside the scan (record_after_scan=False,
                # the path before 2026-11-28's third session) for the names in AT_LAYER
                variants.update({f"{name}@layer": variants[name].replace(record_after_scan=False)
                                 for name in AT_LAYER if name in variants})
                pairs = {name: m.for_round(D_CFG, GAMMA) for name, m in variants.items()}
                W = pairs["index"][0].decode_width(cap)
                rec = random_record(rng, D_CFG, B, W, n)
                # (a) the target's verification step, two merges
                for name in ("old", "index"):
                    tcache = s.target
                    ms, tcache = timeit(lambda c: dec(tp, pairs[name][0], toks, c, rec), tcache)
                    s = s.replace(target=tcache)
                    row[f"verify_sts_{name}_ms"] = ms
                    row[f"verify_speedup_{name}"] = t_ver_dense / ms
                # (c) the draft's steps: the round's opening step (T = 2) and a later step (T = 1) with and without
                # first_step_mask (carry threads the draft cache and the record)
                copy = lambda r: jax.tree_util.tree_map(jnp.copy, r)  # noqa: E731
                two = jnp.ones((B, 2), jnp.int32)
                steps = [("draft_sts_first_step_ms", pairs["index"][1], two),
                         ("draft_sts_later_step_dense_ms", pairs["index"][1], tok[:, None]),
                         ("draft_sts_first_step_rows_ms", pairs["index+rows"][1], two),
                         ("draft_sts_later_step_dense_rows_ms", pairs["index+rows"][1], tok[:, None]),
                         ("draft_sts_first_step_blocks_ms", pairs["index+blocks"][1], two)]
                for name in ["index+mask"] + [f"index+{m}_pool{p}" for m in ("mask", "densemask") for p in POOLS]:
                    suffix = name.split("+")[1]
                    steps += [(f"draft_sts_first_step_{suffix}_ms", pairs[name][1], two),
                              (f"draft_sts_later_step_{suffix}_ms", pairs[name][1], tok[:, None])]
                for name in AT_LAYER:
                    if name in variants:
                        suffix = name.split("+")[1] + "_" if "+" in name else ""
                        steps.append((f"draft_sts_first_step_{suffix}layer_ms", pairs[f"{name}@layer"][1], two))
                        if "mask" not in name:
                            steps.append(("draft_sts_later_step_dense_layer_ms", pairs[f"{name}@layer"][1],
                                          tok[:, None]))
                for label, dm, t in steps:
                    P = dm.pool_width(cap)
                    st = (s.draft, with_pool(rng, copy(rec), P, n) if P else copy(rec))
                    ms, st = timeit(lambda c, dm=dm, t=t: ddec(dp, dm, t, *c), st)
                    s = s.replace(draft=st[0].replace(lengths=jnp.full((B,), n, jnp.int32)))
                    row[label] = ms
                row["floor_bytes"] = dict(target_dense_step=wb_t + B * n * kv_tok_t,
                                          verify_sts=wb_t + B * (budget + GAMMA + 1) * kv_tok_t,
                                          draft_dense_step=wb_d + B * n * kv_tok_d,
                                          # the later masked step gathers W + gamma keys per QUERY head
                                          draft_later_step_mask=wb_d + B * (W + GAMMA) * kv_tok_d
                                          * D_CFG.num_heads // D_CFG.num_kv_heads,
                                          **{f"draft_later_step_mask_pool{p}": wb_d + B * (min(p * W, cap) + GAMMA)
                                             * kv_tok_d * D_CFG.num_heads // D_CFG.num_kv_heads for p in POOLS})
                # (b) whole rounds
                if budget in round_budgets:
                    rounds = {}
                    for name, (tm, dm) in pairs.items():
                        if name not in ROUND_SET:
                            continue
                        ms, s = round_ms(s, tm, dm, copy(rec), dm.init_state(D_CFG, B, cap))
                        rounds[name] = ms
                    row["sts_round_ms"] = rounds
                    for a in range(GAMMA + 1):
                        dense_spec = B * (a + 1) / row0["dense_spec_round_ms"] * 1e3
                        for name, ms in rounds.items():
                            tps = B * (a + 1) / ms * 1e3
                            row[f"sts_{name}_tokens_per_s_a{a}"] = tps
                            row[f"sts_{name}_vs_dense_decode_a{a}"] = tps / row0["dense_decode_tokens_per_s"]
                            row[f"sts_{name}_vs_dense_spec_a{a}"] = tps / dense_spec
                recs.append(row)
                dump(out, recs, wb_t, wb_d)
                line = (f"ctx {ctx} B {B} k {budget}: dense step {t_dense_step:.2f} ms | verify dense {t_ver_dense:.2f} "
                        f"old {row['verify_sts_old_ms']:.2f} ({row['verify_speedup_old']:.2f}x) index "
                        f"{row['verify_sts_index_ms']:.2f} ({row['verify_speedup_index']:.2f}x) | draft dense "
                        f"{t_draft_dense:.2f} first {row['draft_sts_first_step_ms']:.2f} (rows "
                        f"{row['draft_sts_first_step_rows_ms']:.2f}) later dense {row['draft_sts_later_step_dense_ms']:.2f}"
                        f" (rows {row['draft_sts_later_step_dense_rows_ms']:.2f}) mask "
                        + " / ".join(f"{row[k]:.2f}" for k in row if k.startswith("draft_sts_later_step_mask")))
                if "sts_round_ms" in row:
                    line += " | a=%d vs dense decode: " % ACCEPT + ", ".join(
                        f"{name} {row[f'sts_{name}_vs_dense_decode_a{ACCEPT}']:.2f}x" for name in row["sts_round_ms"])
                print(line, flush=True)
            s = tc = dc = tcache = st = dstate = None
        except Exception as e:  # noqa: BLE001 - an OOM cell is reported, not hidden
            traceback.print_exc()
            msg = str(e).splitlines()[0][:300]
            print(f"ctx {ctx} B {B}: failed: {msg}", flush=True)
            recs.append(dict(context=ctx, batch=B, error=msg))
            s = tc = dc = tcache = st = dstate = None
        dump(out, recs, wb_t, wb_d)


if __name__ == "__main__":
    main()
