"""Where an STS round's time goes on the GPU: per-kernel totals of one call of each step (jax.profiler, perfetto
trace), on the shapes of `bench_sts.py` (Llama-3.1-8B target, Llama-3.2-1B draft, random bf16 weights).

Steps profiled at CTX (default 100000), batch B (default 2), budget K (default 512): the target's dense verification
(T = gamma + 1), the STS verification (index merge), the draft's dense step, its STS first step (T = 2) and later
step (dense + top-W; and with `first_step_mask`). STEPS (comma-separated, default all) picks steps by name:
verify_dense, dense_step (T = 1), verify_sts, target_step_1k, draft_dense, draft_first, draft_later_dense, draft_later_mask,
draft_first_rows, draft_later_dense_rows (the two recording steps with `record_selection="rows"`), and whole rounds
(`models.speculative.round_step`, ACCEPT of `bench_sts.py` draft tokens accepted): round_dense (dense speculative
decoding), round_sts (the default STS round; HLO=1 writes its optimized HLO to $OUT/hlo_round_sts.txt.gz).
Writes $OUT/$JSON (default profile_sts.json: per step the wall time (each call waited for), the queued time (calls
dispatched back to back, one wait at the end), the kernels' total time, the launches, and
per kernel name its time and launches per call) and prints the top kernels per step; HLO=1 also writes the STS
verification's optimized HLO to $OUT/hlo_verify_sts.txt and the draft's later step's to
$OUT/hlo_draft_later.txt. LAYOUT: the weights' layout, as in `bench_sts.py`.
"""
import dataclasses, datetime, glob, gzip, json, os, sys, time
from collections import defaultdict
import numpy as np
import jax, jax.numpy as jnp

sys.path.insert(0, os.path.dirname(__file__))
import bench_sts as bs  # noqa: E402
from jsparse.methods.base import make_method  # noqa: E402
from jsparse.methods.sts import STS  # noqa: E402
from models import llama  # noqa: E402
from models.compile_options import model_jit  # noqa: E402
from models.params import is_fused  # noqa: E402
from models.speculative import SpecState, round_step  # noqa: E402

CTX, B, K = int(os.environ.get("CTX", 100000)), int(os.environ.get("B", 2)), int(os.environ.get("K", 512))
T_CFG, D_CFG, GAMMA = bs.T_CFG, bs.D_CFG, bs.GAMMA
STEPS = {x for x in os.environ.get("STEPS", "").split(",") if x}


def wanted(step):
    return not STEPS or step in STEPS


def kernel_totals(trace_dir):
    path = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True))[-1]
    ev = json.load(gzip.open(path))
    ev = ev["traceEvents"] if isinstance(ev, dict) else ev
    pname = {e["pid"]: e["args"]["name"] for e in ev if e.get("ph") == "M" and e.get("name") == "process_name"}
    tot, cnt = defaultdict(float), defaultdict(int)
    for e in ev:
        if e.get("ph") == "X" and "GPU" in pname.get(e.get("pid"), "") and "dur" in e:
            tot[e["name"]] += e["dur"]
            cnt[e["name"]] += 1
    return dict(sorted(tot.items(), key=lambda kv: -kv[1])), cnt


def profile(name, fn, carry, reps=3):
    for _ in range(2):
        carry = jax.block_until_ready(fn(carry))
    t = time.perf_counter()
    for _ in range(reps):
        carry = jax.block_until_ready(fn(carry))
    wall = (time.perf_counter() - t) / reps * 1e3
    t = time.perf_counter()  # the same calls dispatched back to back (as a decode loop does), one wait at the end
    for _ in range(reps):
        carry = fn(carry)
    carry = jax.block_until_ready(carry)
    queued = (time.perf_counter() - t) / reps * 1e3
    d = f"/tmp/prof_{name}"
    with jax.profiler.trace(d, create_perfetto_trace=True):
        for _ in range(reps):
            carry = jax.block_until_ready(fn(carry))
    tot, cnt = kernel_totals(d)
    tot = {k: v / reps for k, v in tot.items()}
    gpu = sum(tot.values()) / 1e3
    print(f"\n== {name}: wall {wall:.2f} ms (queued {queued:.2f}), GPU kernels {gpu:.2f} ms, {len(tot)} kernel names", flush=True)
    for k, v in list(tot.items())[:18]:
        print(f"  {v:9.1f} us  {k[:110]}")
    return dict(wall_ms=wall, queued_ms=queued, gpu_ms=gpu, launches=sum(cnt.values()) / reps, kernels_us=dict(list(tot.items())[:60]),
                kernels_n={k: cnt[k] / reps for k in list(tot)[:60]}), carry


def main():
    out = os.environ.get("OUT", "/tmp")
    tp = bs.make_params(T_CFG, jax.random.key(0))
    dp = bs.make_params(D_CFG, jax.random.key(1))
    rng = np.random.default_rng(0)
    head_map = np.stack([rng.integers(0, D_CFG.num_layers, (T_CFG.num_layers, T_CFG.num_heads)),
                         rng.integers(0, D_CFG.num_heads, (T_CFG.num_layers, T_CFG.num_heads))], -1).astype(np.int32)
    dense = make_method("dense")
    n, cap = CTX, CTX + 640
    tc, dc = bs.cache(T_CFG, B, cap, n), bs.cache(D_CFG, B, cap, n)
    dec = model_jit(lambda p, m, t, c, st: llama.decode(p, T_CFG, m, t, c, st)[1], donate_argnums=(3,))
    ddec = model_jit(lambda p, m, t, c, st: llama.decode(p, D_CFG, m, t, c, st)[1:], donate_argnums=(3, 4))
    tok = jnp.ones((B, 1), jnp.int32)
    toks = jnp.ones((B, GAMMA + 1), jnp.int32)
    base = STS(head_map=jnp.asarray(head_map), budget=float(K), draft_layers=D_CFG.num_layers,
               draft_heads=D_CFG.num_heads)
    tm, dm = base.for_round(D_CFG, GAMMA)
    _, dmm = base.replace(first_step_mask=True).for_round(D_CFG, GAMMA)
    _, dmr = base.replace(record_selection="rows").for_round(D_CFG, GAMMA)
    W = tm.decode_width(cap)
    rec = bs.random_record(rng, D_CFG, B, W, n)
    res = dict(command=f"CTX={CTX} B={B} K={K} STEPS={','.join(sorted(STEPS))} "
                       "python eval/results/h100/sts_bench/profile_sts.py",
               commit=os.environ.get("GIT_COMMIT", ""), context=CTX, batch=B, budget=K, layout=bs.LAYOUT,
               fused_projections=is_fused(tp),
               device=str(jax.devices()[0].device_kind),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    if wanted("verify_dense"):
        res["verify_dense"], tc = profile("verify_dense", lambda c: dec(tp, dense, toks, c, None), tc)
    if wanted("dense_step"):  # target-only dense decoding's step (T = 1)
        res["dense_step"], tc = profile("dense_step", lambda c: dec(tp, dense, tok, c, None), tc)
    if wanted("verify_sts"):
        res["verify_sts"], tc = profile("verify_sts", lambda c: dec(tp, tm, toks, c, rec), tc)
        if os.environ.get("HLO"):  # the optimized HLO of the step: which source ops each fusion holds
            with open(os.path.join(out, "hlo_verify_sts.txt"), "w") as f:
                f.write(dec.lower(tp, tm, toks, tc, rec).compile().as_text())
    if wanted("target_step_1k"):
        res["target_step_1k"], _ = profile("verify_dense_ctx1k", lambda c: dec(tp, dense, toks, c, None),
                                          bs.cache(T_CFG, B, 1664, 1024))
    st = (dc, None)
    if wanted("draft_dense"):
        res["draft_dense"], st = profile("draft_dense", lambda c: ddec(dp, dense, tok, *c), st)
    copy = lambda r: jax.tree_util.tree_map(jnp.copy, r)  # noqa: E731
    dc = st[0].replace(lengths=jnp.full((B,), n, jnp.int32))
    for label, m, t in (("draft_first", dm, jnp.ones((B, 2), jnp.int32)), ("draft_later_dense", dm, tok),
                        ("draft_later_mask", dmm, tok), ("draft_first_rows", dmr, jnp.ones((B, 2), jnp.int32)),
                        ("draft_later_dense_rows", dmr, tok)):
        if not wanted(label):
            continue
        st = (dc, copy(rec))
        res[label], st = profile(label, lambda c, m=m, t=t: ddec(dp, m, t, *c), st)
        if os.environ.get("HLO") and label == "draft_later_dense":
            with open(os.path.join(out, "hlo_draft_later.txt"), "w") as f:
                f.write(ddec.lower(dp, m, t, *st).compile().as_text())
        dc = st[0].replace(lengths=jnp.full((B,), n, jnp.int32))
    # Whole rounds (`round_step`, both caches donated, ACCEPT draft tokens accepted): dense speculative decoding and
    # the default STS round.
    key, limit = jax.random.key(0), jnp.full((B,), GAMMA + 1, jnp.int32)
    fa = jnp.full((B,), bs.ACCEPT, jnp.int32)
    for label, t_m, d_m in (("round_dense", dense, dense), ("round_sts", tm, dm)):
        if not wanted(label):
            continue
        sts = label == "round_sts"
        s = SpecState(target=tc, draft=dc.replace(lengths=tc.lengths), t_state=copy(rec) if sts else None,
                      d_state=d_m.init_state(D_CFG, B, cap) if sts else None, tok=tok[:, 0] + 0, prev=tok[:, 0] + 0)
        fn = lambda st, t_m=t_m, d_m=d_m: round_step(tp, dp, t_m, d_m, st, key, limit, t_cfg=T_CFG,  # noqa: E731
                                                      d_cfg=D_CFG, gamma=GAMMA, forced_accept=fa)[0]
        res[label], s = profile(label, fn, s)
        if os.environ.get("HLO") and sts:
            with gzip.open(os.path.join(out, "hlo_round_sts.txt.gz"), "wt") as f:
                f.write(round_step.lower(tp, dp, t_m, d_m, s, key, limit, t_cfg=T_CFG, d_cfg=D_CFG, gamma=GAMMA,
                                         forced_accept=fa).compile().as_text())
        tc, dc = s.target, s.draft
    json.dump(res, open(os.path.join(out, os.environ.get("JSON", "profile_sts.json")), "w"), indent=1)


if __name__ == "__main__":
    main()
