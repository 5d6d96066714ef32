"""GPU check of the split partials' merge in one launch (`pallas_kernels.sparse_attention.gpu.finish_splits`,
compiled) against XLA's `combine_splits`, at the gathered and dense decodes' shapes (Llama-3.1-8B: Hkv 8, G 4,
D 128; batch 4 and 7; 16 to 64 splits; an empty row and empty splits). Writes $OUT/check_merge.json; exits 1 on a
failure.

    PYTHONPATH=. python eval/results/h200/fixed_cost/check_merge.py
"""

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.sparse_attention import gpu


def main():
    rows, ok_all = [], True
    for S, B in ((16, 4), (64, 4), (37, 7)):
        Hkv, T, G, Gp, D = 8, 1, 4, 16, 128
        rng = np.random.default_rng(S)
        o = jnp.asarray(rng.normal(size=(S, B, Hkv, T, Gp, D)), jnp.float32)
        m = jnp.asarray(rng.normal(size=(S, B, Hkv, T, Gp)) * 3, jnp.float32)
        l = jnp.asarray(rng.uniform(0.5, 2.0, size=(S, B, Hkv, T, Gp)), jnp.float32)
        l = l.at[:, 0, 0, 0].set(0.0).at[1:3, -1].set(0.0)
        m = m.at[:, 0, 0, 0].set(-1e30).at[1:3, -1].set(-1e30)

        def xla(o, m, l):
            out, lse = gpu.combine_splits(o[..., :G, :], m[..., :G], l[..., :G])
            return out.transpose(0, 2, 1, 3, 4).reshape(B, T, Hkv * G, D).astype(jnp.bfloat16), lse
        want, want_lse = jax.jit(xla)(o, m, l)
        got, lse = jax.jit(lambda o, m, l: gpu.finish_splits(o, m, l, G, jnp.bfloat16))(o, m, l)
        f = lambda a: np.asarray(a, np.float32)  # noqa: E731
        row = {"splits": S, "batch": B, "out_max_abs_diff": float(np.max(np.abs(f(got) - f(want)))),
               "out_equal_share": float(np.mean(f(got) == f(want))),
               "lse_max_abs_diff": float(np.max(np.abs(np.where(np.isinf(f(want_lse)), 0, f(lse) - f(want_lse))))),
               "empty_row_zero_and_lse_inf": bool(np.all(f(got)[0, 0, :G] == 0)
                                                  and np.all(np.isneginf(f(lse)[0, 0, 0])))}
        row["ok"] = bool(row["out_max_abs_diff"] <= 2 ** -7 * float(np.max(np.abs(f(want)))) and
                         row["lse_max_abs_diff"] <= 1e-5 and row["empty_row_zero_and_lse_inf"])
        ok_all &= row["ok"]
        rows.append(row)
        print(row, flush=True)
    out = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "commit": os.environ.get("GIT_COMMIT", ""),
           "command": "PYTHONPATH=. python eval/results/h200/fixed_cost/check_merge.py", "rows": rows, "ok": ok_all}
    with open(os.path.join(os.environ.get("OUT", "."), "check_merge.json"), "w") as fh:
        json.dump(out, fh, indent=1)
    sys.exit(0 if ok_all else 1)


if __name__ == "__main__":
    main()
