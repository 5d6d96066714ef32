"""Step ms of each loop variant per (method, context, batch) over the loop_*.json of a folder, and the ratios of
generate's loop (and generate's loop in CUDA graphs) to the bench's fori_loop, best of each variant's runs.
Usage: python eval/results/h100/generate_loop/summarize.py eval/results/h100/generate_loop"""
import glob
import json
import os
import sys

files = sorted(glob.glob(os.path.join(sys.argv[1], "loop_*.json")),
               key=lambda f: int(os.path.basename(f).split("_")[1]))
table = {}
for f in files:
    variant = os.path.basename(f).split("_", 2)[2][:-len(".json")]
    for r in json.load(open(f))["rows"]:
        if r.get("phase") == "decode" and "step_ms" in r:
            table.setdefault((r["method"], r["context"], r["batch"]), {}).setdefault(variant, []).append(r["step_ms"])
print("device:", json.load(open(files[0]))["device"] if files else "-")
for key, by in sorted(table.items()):
    line = " ".join(f"{v}={','.join(f'{x:.3f}' for x in ms)}" for v, ms in by.items())
    ratios = "".join(f" {v}/fori={min(by[v]) / min(by['fori']):.4f}" for v in ("generate", "whilecb")
                     if v in by and "fori" in by)
    print(key, line, ratios)
