"""What each sparse method's share of its bytes-floor speedup would be with parts of its decode step gone, from the
per-kernel profiles here (`jsparse bench profile_decode_step --method M --context 100000 --batch 4 --steps 4`, H200,
5fd9712) and the bytes per step of `eval/results/h200/e2e_state/` (the same shapes; bytes do not depend on the
device; the H100 JSONs of `eval/results/h100/e2e/` predate the bytes model's H2O and Quest counts).

share = (dense step / method step) / (dense bytes / method bytes); the steps are the profiles' GPU spans (busy + idle).
Rows: as profiled; without the GPU's idle time and the XLA kernels under 5 us (in both steps); that and the weight
GEMMs at 4.4 TB/s (in both); the method's selection kernels free (its own step only). Writes budget.json beside this
file and prints a table.

    python3 eval/results/h200/overhead_budget/budget.py
"""

import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
E2E = os.path.join(HERE, "..", "e2e_state")
WEIGHT_BYTES = 15009857536  # Llama-3.1-8B without the embedding table, bf16: the dense row's bytes less its K/V
SELECTION = ("topk_select", "loop_select_fusion", "evosparse_select_candidates", "evosparse_finish_heat",
             "input_scatter_fusion")  # Kascade's and the oracle's pooling is `loop_select_fusion`


def main():
    nbytes = {}
    for part in ("e2e_a", "e2e_b"):
        for r in json.load(open(os.path.join(E2E, f"{part}.json")))["rows"]:
            if r["context"] == 100000 and r["batch"] == 4 and r.get("bytes"):
                nbytes[r["method"]] = r["bytes"]
    prof = {m: json.load(open(os.path.join(HERE, f"profile_{m}_100k_b4.json")))
            for m in ("dense", "kascade", "evosparse", "h2o", "oracle")}

    def parts(d):
        return (d["gpu_span_us_per_step"], d["gpu_idle_us_per_step"] + d["small_xla_us_per_step"],
                d["by_kind"]["gemm"]["us_per_step"] - WEIGHT_BYTES / 4.4e6)

    ds, dfix, dgemm = parts(prof["dense"])
    out = {"command": "python3 eval/results/h200/overhead_budget/budget.py",
           "profiles_commit": prof["dense"]["commit"], "device": prof["dense"]["device"],
           "dense": {"span_us": ds, "idle_and_small_xla_us": dfix, "gemm_over_4p4_tbs_us": dgemm}}
    print("| method | floor | share | no idle, no small XLA | and GEMMs at 4.4 TB/s | selection free (us) |")
    print("|---|---|---|---|---|---|")
    for m in ("kascade", "evosparse", "h2o", "oracle"):
        floor = nbytes["dense"] / nbytes[m]
        ms, mfix, mgemm = parts(prof[m])
        sel = sum(r["us_per_step"] for r in prof[m]["top"] if r["kernel"].startswith(SELECTION))
        share = lambda d, s: d / s / floor  # noqa: E731
        row = {"floor_speedup": floor, "span_us": ms, "share": share(ds, ms),
               "share_no_idle_small_xla": share(ds - dfix, ms - mfix),
               "share_and_gemm_4p4": share(ds - dfix - dgemm, ms - mfix - mgemm),
               "selection_us": sel, "share_selection_free": share(ds, ms - sel)}
        out[m] = row
        print(f"| {m} | {floor:.2f}x | {row['share']:.3f} | {row['share_no_idle_small_xla']:.3f} | "
              f"{row['share_and_gemm_4p4']:.3f} | {row['share_selection_free']:.3f} ({sel:.0f}) |")
    with open(os.path.join(HERE, "budget.json"), "w") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
