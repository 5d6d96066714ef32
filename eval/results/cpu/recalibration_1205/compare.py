"""Compare the shipped SmolLM2 artifacts (jsparse/shipped/smollm2) with those recalibrated here on the corpus as
tokenized since 2026-12-04 (whole text; folders next to this script). Writes compare.json and prints it.

    .venv/bin/python eval/results/cpu/recalibration_1205/compare.py
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from jsparse.provenance import source_commit
from jsparse.retrieval_heads import default_num_heads, top_heads

HERE = Path(__file__).resolve().parent
SHIPPED = HERE.parents[3] / "jsparse" / "shipped" / "smollm2"


def load(folder: Path):
    meta = json.loads((folder / "artifact.json").read_text())["meta"]
    with np.load(folder / "arrays.npz") as z:
        return meta, {k: z[k] for k in z.files}


def kascade(old, new):
    (mo, ao), (mn, an) = old, new
    changed = np.argwhere(ao["head_map"] != an["head_map"])

    def entry(l, h):  # sim[a, l, h1, h2]: the mass of (l, h2)'s own top-k that anchor a's head h1 recovers
        a = max(x for x in mn["anchors"] if x <= l)
        o, n = int(ao["head_map"][l, h]), int(an["head_map"][l, h])
        return {"layer": int(l), "kv_head": int(h), "anchor": a, "old": o, "new": n,
                "sim_old_calibration": [float(ao["similarity"][a, l, o, h]), float(ao["similarity"][a, l, n, h])],
                "sim_new_calibration": [float(an["similarity"][a, l, o, h]), float(an["similarity"][a, l, n, h])]}
    return {"anchors_equal": mo["anchors"] == mn["anchors"], "anchors": mn["anchors"],
            "reuse_layers": int(len(ao["head_map"]) - len(mo["anchors"])),
            # sim_*: [old choice, new choice] under that calibration's statistics
            "head_map_entries_changed": [entry(l, h) for l, h in changed],
            "objective_old": mo["objective"], "objective_new": mn["objective"]}


def tsa(old, new):
    (mo, ao), (mn, an) = old, new
    return {"sparse_layers_equal": bool(np.array_equal(ao["sparse_layers"], an["sparse_layers"])),
            "sparse_layers": an["sparse_layers"].tolist(),
            "max_abs_drift_change": float(np.max(np.abs(ao["drift"] - an["drift"])))}


def evosparse(old, new, num):
    (mo, ao), (mn, an) = old, new
    heads_old, heads_new = top_heads(ao["scores"], num), top_heads(an["scores"], num)
    return {"heads_used": num, "heads_old": heads_old, "heads_new": heads_new,
            "same_set": set(heads_old) == set(heads_new),
            "prompts_new": mn["prompts"], "retrieved_prompts_new": mn["retrieved_prompts"],
            "prompts_old": mo["prompts"], "retrieved_prompts_old": mo["retrieved_prompts"]}


def sts(old, new):
    (mo, ao), (mn, an) = old, new
    rows = []
    for i, k in enumerate(ao["ks"].tolist()):
        mo_, mn_, ov = ao["head_maps"][i], an["head_maps"][i], an["overlap"][i]  # overlap [L, H, Ld, Hd]
        L, H = mo_.shape[:2]

        def mean_overlap(m):
            return float(np.mean([ov[l, h, m[l, h, 0], m[l, h, 1]] for l in range(L) for h in range(H)]))
        rows.append({"k": k, "target_heads": L * H, "mapped_differently": int((mo_ != mn_).any(-1).sum()),
                     "mean_overlap_new_map": mean_overlap(mn_), "mean_overlap_old_map": mean_overlap(mo_),
                     "old_map_share_of_new": mean_overlap(mo_) / mean_overlap(mn_)})
    return rows


def main():
    shipped = {m: load(SHIPPED / m) for m in ("kascade", "tsa", "evosparse", "sts")}
    L, Hq = shipped["evosparse"][1]["scores"].shape  # the method's default head count for the model's shape
    num = default_num_heads(SimpleNamespace(num_layers=L, num_heads=Hq))
    out = {"command": "python eval/results/cpu/recalibration_1205/compare.py", "device": "cpu (2 cores)",
           "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": source_commit(),
           "kascade": kascade(shipped["kascade"], load(HERE / "kascade")),
           "tsa": tsa(shipped["tsa"], load(HERE / "tsa")),
           "evosparse_samples2": evosparse(shipped["evosparse"], load(HERE / "evosparse_samples2"), num),
           "evosparse_samples8": evosparse(shipped["evosparse"], load(HERE / "evosparse_samples8"), num),
           "sts": sts(shipped["sts"], load(HERE / "sts"))}
    text = json.dumps(out)
    (HERE / "compare.json").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
