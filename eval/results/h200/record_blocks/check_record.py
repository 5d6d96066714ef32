"""GPU check of the STS draft's record by blocks (2026-12-01), before timing it.

1. `dense_decode_record_gpu` (the Triton kernel compiled for this GPU, not the interpreter) against
   `dense_decode_record_reference` at the Llama-3.2-1B draft's attention shape (head_dim 64, G = 4), 100K keys,
   rows of different lengths: the output, the log-sum-exps, the logits written in place and the block maxima.
2. Inside the draft model's jitted decode (Llama-3.2-1B shapes, random weights, a random cache of 32K keys, batch 2):
   one two-query step and one one-query step with `record_selection="blocks"` against "rows" from the same state:
   the recorded keys must be the same and their weights equal up to rounding.
Writes $OUT/check_record.json; exits non-zero when a check fails.
Usage (repo root): PYTHONPATH=. OUT=... GIT_COMMIT=... python eval/results/h200/record_blocks/check_record.py
"""
import dataclasses, datetime, json, os, sys
import numpy as np
import jax, jax.numpy as jnp

from eval.bench.model import filled_cache
from jsparse.methods.sts import StsDraft
from models import llama
from models.params import random_params, with_layout
from models.presets import preset
from models.compile_options import model_jit
from pallas_kernels.dense_decode import gpu as dgpu
from pallas_kernels.dense_decode.reference import dense_decode_record_reference

D_CFG = dataclasses.replace(preset("llama3-8b"), hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                            num_kv_heads=8, head_dim=64, tie_word_embeddings=True)
SMOKE = bool(os.environ.get("SMOKE"))  # tiny shapes, the kernel interpreted: a CPU check of the script
if SMOKE:
    D_CFG = dataclasses.replace(D_CFG, vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2)
out_dir = os.environ.get("OUT", "/tmp")
res = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, commit=os.environ.get("GIT_COMMIT", ""),
           date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           command="python eval/results/h200/record_blocks/check_record.py")
ok = True

# 1. the kernel
L, B, Hq, Hkv, D, N = 3, 3, 32, 8, 64, 3_000 if SMOKE else 100_000
ks = jax.random.split(jax.random.key(0), 4)
q = jax.random.normal(ks[0], (B, 1, Hq, D), jnp.bfloat16)
k_all = jax.random.normal(ks[1], (L, B, Hkv, N, D), jnp.bfloat16)
v_all = jax.random.normal(ks[2], (L, B, Hkv, N, D), jnp.bfloat16)
lengths = jnp.array([N, N * 7 // 9, 300], jnp.int32)
record = jax.random.normal(ks[3], (B, Hq, 2, N), jnp.float32)
bmax = jnp.zeros((B, Hq, 2, -(-N // 16)), jnp.float32)
want = dense_decode_record_reference(q, k_all, v_all, jnp.int32(2), lengths, record, bmax, jnp.int32(1), block=16)
got = dgpu.dense_decode_record_gpu(q, k_all, v_all, jnp.int32(2), lengths, jnp.array(record), jnp.array(bmax),
                                   jnp.int32(1), block=16, interpret=SMOKE)
vis = np.arange(N)[None, None] < np.asarray(lengths)[:, None, None]
errs = dict(out=float(jnp.max(jnp.abs(got[0].astype(jnp.float32) - want[0].astype(jnp.float32)))),
            lse=float(jnp.max(jnp.abs(got[1] - want[1]))),
            logits=float(np.max(np.where(vis, np.abs(np.asarray(got[2][:, :, 1]) - np.asarray(want[2][:, :, 1])), 0))),
            other_layer_changed=int(np.sum(np.asarray(got[2][:, :, 0]) != np.asarray(record[:, :, 0]))),
            bmax=float(np.max(np.where(np.isinf(np.asarray(want[3])), 0, np.abs(np.asarray(got[3]) - np.asarray(want[3]))))),
            bmax_inf_mismatch=int(np.sum(np.isneginf(np.asarray(got[3])) != np.isneginf(np.asarray(want[3])))))
res["kernel"] = errs
kernel_ok = (errs["out"] <= 2e-2 and errs["lse"] <= 1e-3 and errs["logits"] <= 2e-3 and errs["bmax"] <= 2e-3
             and errs["other_layer_changed"] == 0 and errs["bmax_inf_mismatch"] == 0)
ok &= kernel_ok
print("kernel vs reference:", errs, "OK" if kernel_ok else "FAILED", flush=True)
del q, k_all, v_all, record, want, got

# 2. in the model: blocks against rows from the same state
B, n, cap = (2, 2_048, 2_048 + 640) if SMOKE else (2, 32_768, 32_768 + 640)
params = with_layout(random_params(D_CFG, jax.random.key(1), jnp.bfloat16), "default", donate=True)
cache = filled_cache(D_CFG, B, n, cap, jnp.bfloat16, seed=0)
step = model_jit(lambda p, m, t, c, st: llama.decode(p, D_CFG, m, t, c, st)[1:])  # no donation: reused inputs
checks = []
for T in (2, 1):
    toks = jnp.ones((B, T), jnp.int32)
    outs = {}
    for sel in ("blocks", "rows"):
        m = StsDraft(budget=64.0 if SMOKE else 512.0, slack=4, record_selection=sel)
        st = m.init_state(D_CFG, B, cap)
        st = st.replace(idx=jnp.where(jnp.arange(st.idx.shape[-1]) < st.idx.shape[-1] - 20, jnp.arange(st.idx.shape[-1]) * (n // 600), -1)
                        .astype(jnp.int32) + jnp.zeros_like(st.idx), val=jnp.full(st.val.shape, 0.01, jnp.float32))
        _, s2 = step(params, m, toks, cache, st)
        outs[sel] = (np.asarray(s2.idx), np.asarray(s2.val))
    (bi, bv), (ri, rv) = outs["blocks"], outs["rows"]
    same = float(np.mean(bi == ri))
    ok_rows = bi >= 0
    verr = float(np.max(np.abs(np.where(ok_rows & (bi == ri), bv - rv, 0.0)) / np.maximum(np.abs(rv), 1e-30)))
    checks.append(dict(T=T, same_key_share=same, max_rel_weight_err=verr, keys_per_row=float((bi >= 0).sum(-1).mean())))
    good = same == 1.0 and verr <= 1e-5
    ok &= good
    print(f"in-model record, T={T}: same keys {same:.6f}, weights max rel err {verr:.2e}", "OK" if good else "FAILED",
          flush=True)
res["in_model"] = checks
res["ok"] = bool(ok)
json.dump(res, open(os.path.join(out_dir, "check_record.json"), "w"), indent=1)
sys.exit(0 if ok else 1)
