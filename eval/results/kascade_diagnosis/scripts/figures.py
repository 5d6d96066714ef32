"""Figures of the Kascade diagnosis from the probe JSONs in ../data (run from this folder's parent)."""
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
data = lambda name: json.load(open(os.path.join(HERE, "data", name)))  # noqa: E731
ANCHORS5 = [0, 1, 3, 14, 24]


def needle_figure():
    fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    for ax, (name, title) in zip(axes, [("probe1_book_2048.json", "book haystack, 2K"),
                                        ("probe1_repeat_2048.json", "repeated-sentence haystack, 2K")]):
        r = data(name)
        L = np.arange(30)
        ax.plot(L, r["dense"]["stats"]["needle_own"], "k-", label="dense model: own top-k (oracle set)")
        ax.plot(L, r["kascade"]["stats"]["needle_used"], "r-o", ms=3, label="Kascade, 5 anchors: the set used")
        ax.plot(L, r["kascade"]["stats"]["needle_own"], "r:", label="Kascade run: the layer's own top-k")
        ax.plot(L, r["every2"]["stats"]["needle_used"], "b-s", ms=3, label="15 anchors (every other layer): used")
        for a in ANCHORS5:
            ax.axvline(a, color="r", alpha=0.15)
        ax.set_title(title)
        ax.set_xlabel("layer")
    axes[0].set_ylabel("needle tokens in the question tile's set")
    axes[0].legend(fontsize=8)
    fig.suptitle("Needle tokens kept for the last query tile (20 prompts, budget 0.1, tile 32)")
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "needle_per_layer.png"), dpi=110)


def coverage_figure():
    r = data("probe1_repeat_2048.json")
    fig, ax = plt.subplots(figsize=(7, 4))
    L = np.arange(30)
    ax.plot(L, r["kascade"]["stats"]["own_cov"], "k-", label="own exact top-k (mean over tiles)")
    ax.plot(L, r["kascade"]["stats"]["used_cov"], "r-o", ms=3, label="reused set (mean over tiles)")
    ax.plot(L, r["kascade"]["stats"]["used_cov_min_tile"], "r:", label="reused set (worst tile)")
    for a in ANCHORS5:
        ax.axvline(a, color="r", alpha=0.15)
    ax.set_xlabel("layer")
    ax.set_ylabel("share of the before-tile attention mass")
    ax.set_title("Kascade, 5 anchors: attention mass kept per layer (2K)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "mass_per_layer.png"), dpi=110)


def passkey_figure():
    variants = ["dense", "oracle", "kascade", "kascade_r2", "kascade_r3", "t85", "t85_r2", "ret9_r2", "t90",
                "t90_r2", "every2_r2", "oracle_b20"]
    sets = [("repo", 2048), ("repo", 4096), ("book", 2048), ("book", 4096)]
    fig, ax = plt.subplots(figsize=(12, 4))
    w = 0.2
    for j, (s, T) in enumerate(sets):
        r = data(f"probe2_{s}_{T}.json")
        ax.bar(np.arange(len(variants)) + (j - 1.5) * w, [sum(r[v]["ok"]) for v in variants], w,
               label=f"{'repeat' if s == 'repo' else 'book'} {T}")
    ax.set_xticks(np.arange(len(variants)), variants, rotation=30, fontsize=8)
    ax.set_ylabel("passkey correct of 20")
    ax.set_title("Kascade prefill variants (mask probe; dense decode), budget 0.1")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "passkey_variants.png"), dpi=110)


if __name__ == "__main__":
    needle_figure()
    coverage_figure()
    passkey_figure()
