"""`tsa+kascade`: TSA's token-compressed prefill around Kascade (Kascade inside the compressed space and for
decode); the method object is a `TSA` whose `inner` is a `Kascade` (see `tsa` and `kascade.prefill_in_coordinates`).
"""

from __future__ import annotations

from jsparse.artifacts import split_artifacts
from jsparse.methods import kascade as kascade_mod
from jsparse.methods.base import register
from jsparse.methods.common import refuse_derived
from jsparse.methods.tsa import ARTIFACT_KIND, TSA


CAPACITY_BUCKETS = 4  # static compressed capacities of the prefill (see the builder's docstring)


@register("tsa+kascade")
class TSAKascade:
    """Builder of TSA around Kascade: TSA prefill with Kascade's attention inside the compressed space, Kascade
    decode (the method object is a `TSA` with `inner` a `Kascade` and selection "kv_head").

    Artifacts: `artifact` is one folder or several separated by os.pathsep, each routed by its kind, e.g.
    `jsparse eval --methods tsa+kascade --artifact tsa+kascade=jsparse/shipped/smollm2/kascade:jsparse/shipped/smollm2/tsa`; or pass
    `kascade_artifact=` / `tsa_artifact=`, or a list of folders (Python). The Kascade artifact is required;
    without a TSA artifact every layer but 0 is TSA-sparse. `budget`, `tile`, `min_tokens` go to Kascade (its
    `prefill_block_size` must stay 1: the compressed coordinates move single tokens); `tau`, `window`, `pool_kernel`, `tsa_min_tokens`,
    `sparse_layers`, `fill`, `local_window`, `local_sinks`, `kept_fraction`, `capacity_buckets` to TSA.
    `capacity_buckets` defaults to CAPACITY_BUCKETS (4, not TSA's 8): each bucket compiles Kascade's whole layer
    again, and at the paper's kept share 0.68 four buckets run it at 0.75 T as eight would.
    """

    EXTRA_OPTIONS = ("tsa_min_tokens",)  # an option of the builder's own (see `jsparse.methods.base.method_options`)

    @classmethod
    def build(cls, cfg=None, artifact: str | None = None, fingerprint: str | None = None,
              kascade_artifact: str | None = None, tsa_artifact: str | None = None, **options):
        kascade_options, tsa_options = split_options(options)  # its errors first, before any artifact is read
        paths = split_artifacts(artifact, (kascade_mod.ARTIFACT_KIND, ARTIFACT_KIND))
        kascade_artifact = kascade_artifact or paths.get(kascade_mod.ARTIFACT_KIND)
        tsa_artifact = tsa_artifact or paths.get(ARTIFACT_KIND)
        inner = kascade_mod.Kascade.build(cfg=cfg, artifact=kascade_artifact, fingerprint=fingerprint,
                                          **kascade_options)
        return around_kascade(inner, cfg=cfg, tsa_artifact=tsa_artifact, fingerprint=fingerprint, **tsa_options)


TSA_OPTIONS = ("tau", "window", "pool_kernel", "sparse_layers", "fill", "local_window", "local_sinks",
               "kept_fraction", "capacity_buckets")


def split_options(options: dict) -> tuple[dict, dict]:
    """`tsa+kascade`'s options -> (Kascade's, TSA's): TSA_OPTIONS and `tsa_min_tokens` (TSA's `min_tokens`) go
    to TSA, the rest to Kascade (whose `prefill_block_size` must be 1: the compressed coordinates move single
    tokens)."""
    bs = options.get("prefill_block_size")
    if bs is not None and bs != 1:
        raise ValueError(f"tsa+kascade does not take prefill_block_size={bs}: TSA's compressed coordinates move "
                         f"single tokens, so Kascade inside TSA selects tokens (use kascade alone for block "
                         f"selections, or prefill_block_size=1)")
    options = refuse_derived("tsa+kascade", dict(options), {
        "selection": ("kv_head", "tsa+kascade (Kascade selects per KV head, so TSA compresses per KV head)"),
        "inner": (None, "tsa+kascade (its inner method is the Kascade it builds)")})
    tsa = {k: options[k] for k in TSA_OPTIONS if k in options}
    if "tsa_min_tokens" in options:
        tsa["min_tokens"] = options["tsa_min_tokens"]
    kascade = {k: v for k, v in options.items() if k not in TSA_OPTIONS and k != "tsa_min_tokens"}
    return kascade, tsa


def around_kascade(kascade, cfg=None, tsa_artifact: str | None = None, fingerprint: str | None = None,
                   **tsa_options) -> TSA:
    """TSA around a built Kascade, as `tsa+kascade` builds it: selection "kv_head", CAPACITY_BUCKETS buckets unless
    `capacity_buckets` is given, the sparse layers from `tsa_artifact` (None: every layer but 0)."""
    tsa_options.setdefault("capacity_buckets", CAPACITY_BUCKETS)
    return TSA.build(cfg=cfg, artifact=tsa_artifact, fingerprint=fingerprint, inner=kascade, selection="kv_head",
                     **tsa_options)
