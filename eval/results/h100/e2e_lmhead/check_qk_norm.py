"""GPU check of `rope_write` with Qwen3's q/k norm (the heads normed by `norm_heads` in XLA, then the Triton kernel),
compiled, at Qwen3-8B's decode shapes (Hq 32, Hkv 8, D 128), batch 3 (rows padded to 8), bf16, a 4096-position cache
of 4 layers, one position past the cache (dropped).

Both the kernel path and XLA's compiled reference (which may keep the normed heads in f32 into the rotation) are
measured against a float64 numpy truth computed from the same bf16 inputs, the error of each q and k head in units of
that head's largest magnitude (a bf16 ulp there is 2^-8 = 0.0039 of it). Passes when the kernel path's largest error
is within 2^-7, two such ulps (it rounds the normed heads and the rotated result to bf16), its v rows equal the
reference's bit for bit, and nothing but the written rows changed. Writes $OUT/check_qk_norm.json; exits 1 on a failure.

    GIT_COMMIT=<sha> PYTHONPATH=. python eval/results/h100/e2e_lmhead/check_qk_norm.py
"""

import json
import os
import sys
from datetime import datetime, timezone

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.kv_write import rope_write
from pallas_kernels.kv_write.reference import rope_write_reference


def main():
    B, T, pad, Hq, Hkv, D, L, N, layer, eps = 3, 1, 5, 32, 8, 128, 4, 4096, 2, 1e-6
    ks = jax.random.split(jax.random.key(0), 6)
    bf = jnp.bfloat16
    qkv = (3.0 * jax.random.normal(ks[0], (B * T + pad, Hq + 2 * Hkv, D), jnp.float32)).astype(bf)
    ck = jax.random.normal(ks[1], (L, B, Hkv, N, D), jnp.float32).astype(bf)
    cv = jax.random.normal(ks[2], (L, B, Hkv, N, D), jnp.float32).astype(bf)
    pos = (jax.random.randint(ks[3], (B, 1), 1000, N - T) + jnp.arange(T)[None]).astype(jnp.int32)
    pos = pos.at[2, 0].set(N + 3)  # dropped
    qn = (1.0 + 0.3 * jax.random.normal(ks[4], (D,))).astype(bf)
    kn = (1.0 + 0.3 * jax.random.normal(ks[5], (D,))).astype(bf)
    inv_freq = jnp.asarray(1.0 / (1000000.0 ** (np.arange(0, D, 2, dtype=np.float32) / D)))
    args = (qkv, pos, inv_freq, ck, cv, jnp.int32(layer))
    got = jax.jit(lambda *a: rope_write(*a, Hq, Hkv, qn, kn, eps))(*args)
    want = jax.jit(lambda *a: rope_write_reference(*a, Hq, Hkv, qn, kn, eps))(*args)

    f = lambda a: np.asarray(a, np.float64)  # noqa: E731
    x, p = f(qkv), np.asarray(pos)
    ang_f = f(inv_freq)

    def truth(a, w, position):  # a: [H, D] -> normed and rotated, float64
        a = a / np.sqrt(np.mean(a * a, axis=-1, keepdims=True) + eps) * f(w)
        ang = position * np.concatenate([ang_f, ang_f])
        return a * np.cos(ang) + np.concatenate([-a[:, D // 2:], a[:, :D // 2]], axis=-1) * np.sin(ang)

    err = {"q_kernel": 0.0, "q_xla": 0.0, "k_kernel": 0.0, "k_xla": 0.0}
    for b in range(B):
        t = int(p[b, 0])
        tq = truth(x[b, :Hq], qn, t)
        scale = np.max(np.abs(tq), axis=-1, keepdims=True)
        err["q_kernel"] = max(err["q_kernel"], float(np.max(np.abs(f(got[0][b, 0]) - tq) / scale)))
        err["q_xla"] = max(err["q_xla"], float(np.max(np.abs(f(want[0][b, 0]) - tq) / scale)))
        if t < N:
            tk = truth(x[b, Hq:Hq + Hkv], kn, t)
            scale = np.max(np.abs(tk), axis=-1, keepdims=True)
            err["k_kernel"] = max(err["k_kernel"], float(np.max(np.abs(f(got[1][layer, b, :, t]) - tk) / scale)))
            err["k_xla"] = max(err["k_xla"], float(np.max(np.abs(f(want[1][layer, b, :, t]) - tk) / scale)))
    written = int(np.sum(p < N)) * Hkv
    changed_k = int(np.sum(np.any(f(got[1]) != f(ck), axis=-1)))
    changed_v = int(np.sum(np.any(f(got[2]) != f(cv), axis=-1)))
    v_equal = bool(np.array_equal(f(got[2]), f(want[2])))
    ok = err["q_kernel"] <= 2 ** -7 and err["k_kernel"] <= 2 ** -7 and v_equal and changed_k <= written \
        and changed_v <= written
    out = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
           "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": os.environ.get("GIT_COMMIT", ""),
           "command": "PYTHONPATH=. python eval/results/h100/e2e_lmhead/check_qk_norm.py",
           "shape": {"B": B, "T": T, "pad": pad, "Hq": Hq, "Hkv": Hkv, "D": D, "L": L, "N": N},
           "max_error_in_head_max": err, "bar": 2 ** -7, "v_equal_to_reference": v_equal,
           "k_rows_changed": changed_k, "v_rows_changed": changed_v, "rows_written": written, "ok": bool(ok)}
    print(json.dumps(out), flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "check_qk_norm.json"), "w") as fh:
        json.dump(out, fh, indent=1)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
