"""What each sparse method's share of its bytes-floor speedup would be with parts of its decode step gone, from
per-kernel profiles (`jsparse bench profile_decode_step --method M --context 100000 --batch 4 --steps 4`: by
default the H200 ones here, 5fd9712) and the bytes per step of a `jsparse bench model` run at the same shapes (by
default `eval/results/h200/e2e_state/`; bytes do not depend on the device).

share = (dense step / method step) / (dense bytes / method bytes); the steps are the profiles' GPU spans (busy + idle).
Rows: as profiled; without the GPU's idle time and the XLA kernels under 5 us (in both steps); that and the weight
GEMMs at --gemm-tbs (in both; 4.4 TB/s on the H200, 3.1 on the H100: about 92% of each one's peak); the method's
selection kernels free (its own step only). Writes budget.json beside the profiles (or --out) and prints a table.

    python3 eval/results/h200/overhead_budget/budget.py
    python3 eval/results/h200/overhead_budget/budget.py --profiles eval/results/h100/overhead_budget \
        --bytes eval/results/h100/e2e_1205 --gemm-tbs 3.1
"""

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
E2E = os.path.join(HERE, "..", "e2e_state")
WEIGHT_BYTES = 15009857536  # Llama-3.1-8B without the embedding table, bf16: the dense row's bytes less its K/V
SELECTION = ("topk_select", "loop_select_fusion", "evosparse_select_candidates", "evosparse_finish_heat",
             "input_scatter_fusion")  # Kascade's and the oracle's pooling is `loop_select_fusion`


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profiles", default=HERE, help="the folder of profile_{method}_100k_b4.json (default: here)")
    p.add_argument("--bytes", default=E2E, help="the folder of the bench's e2e_a.json and e2e_b.json, whose 100K, "
                   "batch 4 rows give each method's bytes per step (default: eval/results/h200/e2e_state)")
    p.add_argument("--gemm-tbs", type=float, default=4.4, help="the weight GEMMs' bandwidth of the third share, TB/s")
    p.add_argument("--out", default=None, help="the JSON written (default: budget.json in --profiles)")
    a = p.parse_args(argv)
    nbytes = {}
    for part in ("e2e_a", "e2e_b"):
        for r in json.load(open(os.path.join(a.bytes, f"{part}.json")))["rows"]:
            if r["context"] == 100000 and r["batch"] == 4 and r.get("bytes"):
                nbytes[r["method"]] = r["bytes"]
    prof = {m: json.load(open(os.path.join(a.profiles, f"profile_{m}_100k_b4.json")))
            for m in ("dense", "kascade", "evosparse", "h2o", "oracle")}

    def parts(d):
        return (d["gpu_span_us_per_step"], d["gpu_idle_us_per_step"] + d["small_xla_us_per_step"],
                d["by_kind"]["gemm"]["us_per_step"] - WEIGHT_BYTES / (a.gemm_tbs * 1e6))

    ds, dfix, dgemm = parts(prof["dense"])
    rel = lambda path: os.path.relpath(os.path.abspath(path))  # noqa: E731
    out = {"command": " ".join(["python3", rel(__file__)] + (sys.argv[1:] if argv is None else list(argv))),
           "profiles_commit": prof["dense"]["commit"], "device": prof["dense"]["device"],
           "bytes_from": rel(a.bytes), "gemm_target_tbs": a.gemm_tbs,
           "dense": {"span_us": ds, "idle_and_small_xla_us": dfix, "gemm_over_target_us": dgemm}}
    print(f"| method | floor | share | no idle, no small XLA | and GEMMs at {a.gemm_tbs:g} TB/s | selection free (us) |")
    print("|---|---|---|---|---|---|")
    for m in ("kascade", "evosparse", "h2o", "oracle"):
        floor = nbytes["dense"] / nbytes[m]
        ms, mfix, mgemm = parts(prof[m])
        sel = sum(r["us_per_step"] for r in prof[m]["top"] if r["kernel"].startswith(SELECTION))
        share = lambda d, s: d / s / floor  # noqa: E731
        row = {"floor_speedup": floor, "span_us": ms, "share": share(ds, ms),
               "share_no_idle_small_xla": share(ds - dfix, ms - mfix),
               "share_and_gemm_target": share(ds - dfix - dgemm, ms - mfix - mgemm),
               "selection_us": sel, "share_selection_free": share(ds, ms - sel)}
        out[m] = row
        print(f"| {m} | {floor:.2f}x | {row['share']:.3f} | {row['share_no_idle_small_xla']:.3f} | "
              f"{row['share_and_gemm_target']:.3f} | {row['share_selection_free']:.3f} ({sel:.0f}) |")
    with open(a.out or os.path.join(a.profiles, "budget.json"), "w") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
