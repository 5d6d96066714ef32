"""STS speculative decoding vs dense on Llama-3.1-8B-shaped target + Llama-3.2-1B-shaped draft (random weights).

Per (context, batch, budget): target-only dense decode step; the target's verification step (T = gamma + 1) dense
vs STS; whole rounds (draft gamma steps + verification) for dense speculative and STS speculative decoding with
the accepted length forced to a (0..gamma) per round; tokens/s = B * (a + 1) / round time. Bytes floors: weights +
KV read per step. Writes JSON to $OUT/sts_bench.json and prints a table.
"""
import dataclasses, json, os, sys, time, datetime, subprocess
import numpy as np
import jax, jax.numpy as jnp

from jsparse.methods.base import make_method
from jsparse.methods.sts import STS, DraftRecord, StsDraft
from models import llama
from models.cache import KVCache
from models.params import random_params
from models.presets import preset
from models.speculative import SpecState, round_step

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


def timeit(fn, carry, n=5, warm=2):
    """fn(carry) -> carry (donated buffers threaded through); median ms of n calls after warm-up."""
    for _ in range(warm):
        carry = jax.block_until_ready(fn(carry))
    ts = []
    for _ in range(n):
        t = time.perf_counter(); carry = jax.block_until_ready(fn(carry)); ts.append(time.perf_counter() - t)
    return float(np.median(ts)) * 1e3, carry


def cache(cfg, B, N, n):
    shape = (cfg.num_layers, B, cfg.num_kv_heads, N, cfg.head_dim)
    fill = jax.jit(lambda: jnp.full(shape, 0.01, BF))  # one allocation per buffer
    return KVCache(k=fill(), v=fill(), lengths=jnp.full((B,), n, jnp.int32))


def param_bytes(p):
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(p))


def main():
    out = os.environ.get("OUT", "/tmp")
    tp = random_params(T_CFG, jax.random.key(0), BF)
    dp = random_params(D_CFG, jax.random.key(1), BF)
    wb_t, wb_d = param_bytes(tp), param_bytes(dp)
    kv_tok_t = 2 * T_CFG.num_layers * T_CFG.num_kv_heads * T_CFG.head_dim * 2
    kv_tok_d = 2 * D_CFG.num_layers * D_CFG.num_kv_heads * D_CFG.head_dim * 2
    rng = np.random.default_rng(0)
    head_map = np.stack([rng.integers(0, D_CFG.num_layers, (T_CFG.num_layers, T_CFG.num_heads)),
                         rng.integers(0, D_CFG.num_heads, (T_CFG.num_layers, T_CFG.num_heads))], -1).astype(np.int32)
    dense = make_method("dense")
    cells = [(c, b) for c, bs in (((1024, (1, 2)),) if SMOKE else ((32768, (1, 8)), (100000, (1, 3, 2)))) for b in bs]
    if os.environ.get("CELLS"):  # e.g. "100000:3,100000:2"
        cells = [tuple(int(x) for x in c.split(":")) for c in os.environ["CELLS"].split(",")]
    recs, done100 = [], set()
    for ctx, B in cells:
        if ctx == 100000 and B == 2 and 3 in done100:
            continue
        n = ctx
        cap = ctx + 640
        try:
            tc, dc = cache(T_CFG, B, cap, n), cache(D_CFG, B, cap, n)
            tok = jnp.ones((B,), jnp.int32)
            # target-only dense decode step (cache donated and threaded, as in generation)
            dec = jax.jit(lambda p, m, t, c, st: llama.decode(p, T_CFG, m, t, c, st)[1], donate_argnums=(3,))
            t_dense_step, tc = timeit(lambda c: dec(tp, dense, tok[:, None], c, None), tc)
            toks = jnp.ones((B, GAMMA + 1), jnp.int32)
            t_ver_dense, tc = timeit(lambda c: dec(tp, dense, toks, c, None), tc)
            ddec = jax.jit(lambda p, t, c: llama.decode(p, D_CFG, dense, t, c, None)[1], donate_argnums=(2,))
            t_draft_step, dc = timeit(lambda c: ddec(dp, tok[:, None], c), dc)
            s = SpecState(target=tc, draft=dc, t_state=None, d_state=None, tok=tok, prev=tok + 0)
            limit = jnp.full((B,), GAMMA + 1, jnp.int32)
            key = jax.random.key(0)
            for budget in ((128, 256) if SMOKE else (512, 4096)):
                sts = STS(head_map=jnp.asarray(head_map), budget=float(budget), draft_layers=D_CFG.num_layers,
                          draft_heads=D_CFG.num_heads)
                t_m, d_m = sts.for_round(D_CFG, GAMMA)
                W = t_m.decode_width(cap)
                rec = DraftRecord(idx=jnp.asarray(rng.integers(0, n, (D_CFG.num_layers, B, D_CFG.num_heads, 1, W)),
                                                  jnp.int32),
                                  val=jnp.asarray(rng.random((D_CFG.num_layers, B, D_CFG.num_heads, 1, W)), jnp.float32))
                tcache = s.target
                t_ver_sts, tcache = timeit(lambda c: dec(tp, t_m, toks, c, rec), tcache)
                s = s.replace(target=tcache)
                row = dict(context=ctx, batch=B, budget_tokens=budget, gamma=GAMMA,
                           target_dense_step_ms=t_dense_step, verify_dense_ms=t_ver_dense, verify_sts_ms=t_ver_sts,
                           verify_speedup=t_ver_dense / t_ver_sts, draft_dense_step_ms=t_draft_step,
                           floor_bytes=dict(target_dense_step=wb_t + B * n * kv_tok_t,
                                            verify_sts=wb_t + B * (budget + GAMMA + 1) * kv_tok_t,
                                            draft_step=wb_d + B * n * kv_tok_d))
                rounds = {}
                for name, (tm, dm) in {"dense_spec": (dense, dense), "sts_spec": (t_m, d_m)}.items():
                    for a in (0, 1, 3, GAMMA):
                        if name == "sts_spec":  # fresh states (the round donates its input)
                            s = s.replace(t_state=jax.tree_util.tree_map(jnp.copy, rec),
                                          d_state=d_m.init_state(D_CFG, B, cap))
                        else:
                            s = s.replace(t_state=None, d_state=None)
                        fa = jnp.full((B,), a, jnp.int32)
                        fn = lambda st, tm=tm, dm=dm, fa=fa: round_step(tp, dp, tm, dm, st, key, limit, t_cfg=T_CFG,
                                                                       d_cfg=D_CFG, gamma=GAMMA, forced_accept=fa)[0]
                        ms, s = timeit(fn, s, n=3, warm=1)
                        rounds[f"{name}_a{a}"] = dict(round_ms=ms, tokens_per_s=B * (a + 1) / ms * 1e3)
                row["rounds"] = rounds
                row["dense_decode_tokens_per_s"] = B / t_dense_step * 1e3
                for a in (0, 1, 3, GAMMA):
                    row[f"sts_vs_dense_decode_a{a}"] = rounds[f"sts_spec_a{a}"]["tokens_per_s"] / row["dense_decode_tokens_per_s"]
                    row[f"sts_vs_dense_spec_a{a}"] = rounds[f"sts_spec_a{a}"]["tokens_per_s"] / rounds[f"dense_spec_a{a}"]["tokens_per_s"]
                recs.append(row)
                print(f"ctx {ctx} B {B} k {budget}: dense step {t_dense_step:.2f} ms | verify dense {t_ver_dense:.2f} "
                      f"sts {t_ver_sts:.2f} ({t_ver_dense / t_ver_sts:.2f}x) | draft step {t_draft_step:.2f} | "
                      f"a=3: sts {rounds['sts_spec_a3']['tokens_per_s']:.0f} tok/s, dense spec "
                      f"{rounds['dense_spec_a3']['tokens_per_s']:.0f}, dense decode {row['dense_decode_tokens_per_s']:.0f} "
                      f"-> {row['sts_vs_dense_decode_a3']:.2f}x", flush=True)
            s = tc = dc = tcache = None
            if ctx == 100000:
                done100.add(B)
            del tc, dc
        except Exception as e:  # noqa: BLE001 - an OOM cell is reported, not hidden
            msg = str(e).splitlines()[0][:300]
            print(f"ctx {ctx} B {B}: failed: {msg}", flush=True)
            recs.append(dict(context=ctx, batch=B, error=msg))
        json.dump(dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                       date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       commit=os.environ.get("GIT_COMMIT", ""), command="python eval/bench/sts.py (see NOTES)",
                       target="llama3-8b shapes", draft="llama3.2-1b shapes", dtype="bfloat16",
                       weights_bytes=dict(target=wb_t, draft=wb_d), records=recs),
                  open(os.path.join(out, os.environ.get("JSON", "sts_bench.json")), "w"), indent=1)


if __name__ == "__main__":
    main()
