"""Calibration artifacts: small files keyed by a fingerprint of the model they were made for.

An artifact is a folder holding `artifact.json` (kind, model fingerprint, model name, metadata) and
`arrays.npz` (the calibrated arrays). Loading an artifact for a model whose fingerprint differs is an error.

The fingerprint hashes the model config and a sample of every weight tensor (4096 values per leaf, taken on the
device and rounded to bf16, so the f32 and bf16 loads of one checkpoint agree), so it is cheap for an 8B checkpoint
yet changes when any tensor is replaced. The sampled positions follow a golden-ratio (Weyl) sequence over the
flattened leaf, so they spread over every axis: a plain stride of n // 4096 is a multiple of the row length for
power-of-two shapes and would read one column only (one query head of `wq`, one vocabulary column of `lm_head`).
Artifacts record the scheme (`FINGERPRINT_SCHEME`); one made under an earlier scheme is refused with a message
that says to calibrate again.

The bundled model's artifacts ship inside the package, in `jsparse/shipped/smollm2/<kind>` (`shipped_artifact`). A
relative artifact path that is not a folder in the working directory is looked up under the folder jsparse is
installed in (a clone's root, or site-packages), so `jsparse/shipped/smollm2/kascade` names the shipped Kascade
artifact from any working directory, and so does a path a results.json records relative to the repository.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import io
import json
import os
import zipfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jsparse.provenance import INSTALL_ROOT
from models.config import ModelConfig
from models.params import Slice, projection_views

ARTIFACT_JSON = "artifact.json"
ARRAYS_NPZ = "arrays.npz"
_SAMPLES_PER_LEAF = 4096
# 1: a stride of n // 4096 (before 2026-12-03); 2: golden-ratio positions (`sample_positions`).
FINGERPRINT_SCHEME = 2
_GOLDEN = (5 ** 0.5 - 1) / 2


class ArtifactError(ValueError):
    """An artifact that is missing, corrupt, of the wrong kind, or made for another model."""


SHIPPED = os.path.join("jsparse", "shipped")


def artifact_folder(path) -> str:
    """`path` as given, unless it is relative and names no file or folder from the working directory while it names
    a folder under INSTALL_ROOT (`jsparse/shipped/...` from anywhere): then that folder."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"artifact={path!r}: expected the path of an artifact folder (a str)")
    path = os.fspath(path)
    if os.path.isabs(path) or os.path.exists(path):
        return path
    inside = os.path.join(INSTALL_ROOT, path)
    return inside if os.path.isdir(inside) else path


def _moved(path: str) -> str:
    """A hint for a path artifacts/<model>/<kind>, where the shipped artifacts were before 2026-12-05, when one of
    that model and kind ships."""
    parts = os.path.normpath(path).split(os.sep)
    if parts[-3:-2] == ["artifacts"] and os.path.isdir(os.path.join(INSTALL_ROOT, SHIPPED, *parts[-2:])):
        return (f"; the shipped artifacts moved from artifacts/<model>/<kind> to {SHIPPED}/<model>/<kind> "
                f"(jsparse.shipped_artifact({parts[-1]!r}))")
    return ""


def shipped_artifact(kind: str, model: str = "smollm2") -> str:
    """The absolute path of the artifact of `kind` shipped for the bundled `model` ("kascade", "tsa", "evosparse",
    "sts", "butler" for "smollm2").

    Raises:
      ArtifactError: no such shipped artifact, naming those there are."""
    root = os.path.join(INSTALL_ROOT, SHIPPED)
    path = os.path.join(root, model, kind)
    if not os.path.isfile(os.path.join(path, ARTIFACT_JSON)):
        there = sorted(f"{m}/{k}" for m in (os.listdir(root) if os.path.isdir(root) else [])
                       for k in sorted(os.listdir(os.path.join(root, m)))
                       if os.path.isfile(os.path.join(root, m, k, ARTIFACT_JSON)))
        raise ArtifactError(f"no shipped {kind!r} artifact for model {model!r}: expected one of {there} (under "
                            f"{root})")
    return path


def sample_positions(n: int, samples: int = _SAMPLES_PER_LEAF) -> np.ndarray:
    """int64[<= samples] ascending flat positions in [0, n): every position when n <= samples, else the distinct
    floor(n * frac(i * phi)) for i < samples (phi the golden ratio), which spread over every axis of the leaf."""
    if n <= samples:
        return np.arange(n, dtype=np.int64)
    frac = np.modf(np.arange(samples, dtype=np.float64) * _GOLDEN)[0]
    return np.unique(np.minimum((frac * n).astype(np.int64), n - 1))


def model_fingerprint(cfg: ModelConfig, params: Any) -> str:
    """A short hex digest of the config and a sample of every weight (`sample_positions`)."""
    h = hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True).encode())
    # The separate q/k/v and gate/up layout's leaves, read in place from fused params: one fingerprint for both.
    for path, leaf in jax.tree_util.tree_leaves_with_path(projection_views(params)):
        shape = tuple(leaf.shape)
        index = list(np.unravel_index(sample_positions(int(np.prod(shape))), shape))
        if isinstance(leaf, Slice):
            index[leaf.axis] = index[leaf.axis] + leaf.start
            leaf = leaf.array
        # Sampled values rounded to bf16, so the f32 and bf16 loads of one checkpoint share a fingerprint.
        sample = np.asarray(jax.device_get(jnp.asarray(leaf)[tuple(index)].astype(jnp.bfloat16)))
        h.update(jax.tree_util.keystr(path).encode())
        h.update(str(shape).encode())
        h.update(sample.view(np.uint16).tobytes())
    return h.hexdigest()[:16]


def fingerprint(model: Any) -> str:
    """The fingerprint of a loaded model (`models.bundled.LoadedModel`: its cfg and params), computed once and
    cached on the model object; calibration artifacts are keyed by it."""
    if not (hasattr(model, "cfg") and hasattr(model, "params")):
        raise ValueError(f"model={model!r:.80}: expected a loaded model (`jsparse.load(SPEC)`), whose cfg and params "
                         "the fingerprint hashes")
    fp = getattr(model, "_fingerprint", None)
    if fp is None:
        fp = model_fingerprint(model.cfg, model.params)
        object.__setattr__(model, "_fingerprint", fp)
    return fp


@dataclasses.dataclass
class Artifact:
    kind: str
    fingerprint: str
    arrays: dict[str, np.ndarray]
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)


class _Arrays(dict):
    """An artifact's arrays: a missing name is an ArtifactError naming the folder (a corrupt or hand-edited artifact),
    not a bare KeyError deep in a method's loader."""

    def __init__(self, arrays, path: str, kind: str):
        super().__init__(arrays)
        self._where = (path, kind)

    def __missing__(self, name):
        path, kind = self._where
        raise ArtifactError(f"{kind} artifact at {path!r} is corrupt: {ARRAYS_NPZ} has no array {name!r} (it holds "
                            f"{sorted(self)}); make it again with {_make_command(kind, path)}")


def save_artifact(path: str, artifact: Artifact) -> None:
    """Writes `artifact` into folder `path` (made if needed): artifact.json, which records the sha256 of the arrays,
    then arrays.npz, each under a temporary name renamed into place. A save interrupted between the two renames
    leaves the new artifact.json beside the earlier arrays, which `load_artifact` refuses by the digest (never a
    half-written file, and never one model's metadata read with another's arrays)."""
    os.makedirs(path, exist_ok=True)
    buf = io.BytesIO()
    np.savez(buf, **artifact.arrays)
    data = buf.getvalue()
    info = {"kind": artifact.kind, "model_fingerprint": artifact.fingerprint, "fingerprint_scheme": FINGERPRINT_SCHEME,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "arrays": sorted(artifact.arrays), "arrays_sha256": hashlib.sha256(data).hexdigest(),
            "meta": artifact.meta}
    text = json.dumps(info, indent=2, default=_json_default)  # before any write: a meta value json refuses fails here
    write_replace(os.path.join(path, ARTIFACT_JSON), text.encode())
    write_replace(os.path.join(path, ARRAYS_NPZ), data)


def update_artifact_meta(path: str, kind: str, **meta) -> Artifact:
    """Adds or replaces metadata keys of the artifact at `path` (checked as `load_artifact` checks it), rewriting only
    its artifact.json, atomically (its arrays and their digest stay). Returns the artifact as now saved."""
    path = artifact_folder(path)
    art = load_artifact(path, kind)
    info = _read_info(path)
    info["meta"] = {**info["meta"], **meta}
    write_replace(os.path.join(path, ARTIFACT_JSON), json.dumps(info, indent=2, default=_json_default).encode())
    art.meta = info["meta"]
    return art


def _read_info(path: str):
    """The parsed artifact.json of folder `path` (OSError; ValueError for bytes that are not UTF-8 JSON)."""
    with open(os.path.join(path, ARTIFACT_JSON), "rb") as f:
        return json.loads(f.read().decode("utf-8"))


def calibrated_for(artifact: str) -> dict[str, str]:
    """{folder: the model fingerprint its artifact.json records} for an `artifact` option (folders joined by
    os.pathsep, as tsa+kascade takes them); folders without a readable fingerprint are left out (the method's builder
    has refused them already)."""
    out = {}
    for path in str(artifact).split(os.pathsep):
        try:
            fp = _read_info(artifact_folder(path)).get("model_fingerprint")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(fp, str):
            out[path] = fp
    return out


def check_calibrated_for(method: Any, model: Any) -> None:
    """A method built from artifacts (`jsparse.make_method`/`build_method`, which record their fingerprints on it)
    runs only on the model they were calibrated for: ArtifactError naming the folder and both fingerprints."""
    recorded = getattr(method, "_calibrated_for", None) or {}
    own = fingerprint(model) if recorded else None
    for path, fp in recorded.items():
        if fp != own:
            raise ArtifactError(f"the method's artifact at {path!r} was calibrated for model fingerprint {fp!r}, but "
                                f"this model ({getattr(model, 'name', '?')}) has fingerprint {own!r}: build the "
                                "method for this model (an artifact calibrated on it)")


def meta_number(art: Artifact, path: str, name: str, default=None, integer: bool = False) -> int | float:
    """`art.meta[name]` (`default` when absent) as a float (an int with `integer`): a method's setting its
    calibration used; ArtifactError naming the folder when it is not a number (an integer)."""
    value = art.meta.get(name, default)
    ok = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, ok):
        raise ArtifactError(f"{art.kind} artifact at {path!r} is corrupt: meta {name}={value!r}, expected "
                            f"{'an integer' if integer else 'a number'}")
    return int(value) if integer else float(value)


def write_replace(target: str, data: bytes) -> None:
    """Writes `data` to `target` through a temporary file renamed over it; a write cut short leaves no temporary file
    (a predictor's arrays can be hundreds of MB)."""
    tmp = target + ".tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def load_artifact(path: str, kind: str, fingerprint: str | None = None) -> Artifact:
    """Loads an artifact of `kind`; with `fingerprint`, raises ArtifactError if it was made for another model. A
    missing, corrupt or mismatched file (arrays other than those artifact.json lists or digests, a field of the
    wrong type) is an ArtifactError naming the folder. A relative path is found as `artifact_folder` says."""
    path = artifact_folder(path)
    meta_path = os.path.join(path, ARTIFACT_JSON)
    if not os.path.exists(meta_path):
        raise ArtifactError(f"no artifact at {path!r}: {ARTIFACT_JSON} is missing (make one with "
                            f"{_make_command(kind, path)}){_moved(path)}")
    try:
        info = _read_info(path)
        with open(os.path.join(path, ARRAYS_NPZ), "rb") as f:
            data = f.read()
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as e:  # (JSON and UTF-8 errors: ValueError)
        raise ArtifactError(f"artifact at {path!r} is corrupt: {type(e).__name__}: {e}") from e
    if not isinstance(info, dict):
        raise ArtifactError(f"artifact at {path!r} is corrupt: {ARTIFACT_JSON} holds a {type(info).__name__}, "
                            "expected an object")
    for key, types, what in (("kind", str, "a string"), ("model_fingerprint", str, "a string"),
                             ("arrays", list, "a list of names"), ("meta", dict, "an object")):
        if not isinstance(info.get(key), types):
            raise ArtifactError(f"artifact at {path!r} is corrupt: {ARTIFACT_JSON} has {key}={info.get(key)!r}, "
                                f"expected {what}")
    if sorted(arrays) != sorted(info["arrays"]):
        raise ArtifactError(f"artifact at {path!r} is corrupt: {ARTIFACT_JSON} lists arrays {sorted(info['arrays'])}, "
                            f"{ARRAYS_NPZ} holds {sorted(arrays)} (a save interrupted between its two files?)")
    digest = info.get("arrays_sha256")  # absent in artifacts saved before 2026-12-04
    if digest is not None and digest != hashlib.sha256(data).hexdigest():
        raise ArtifactError(f"artifact at {path!r} is corrupt: {ARRAYS_NPZ} is not the file {ARTIFACT_JSON} was saved "
                            f"with (its sha256 differs: a save interrupted between its two files, or a file copied "
                            f"from another artifact); make it again with {_make_command(kind, path)}")
    if info["kind"] != kind:
        raise ArtifactError(f"artifact at {path!r} is a {info['kind']!r} artifact, expected {kind!r}")
    if fingerprint is not None and info["model_fingerprint"] != fingerprint:
        scheme = info.get("fingerprint_scheme", 1)
        if scheme != FINGERPRINT_SCHEME:
            raise ArtifactError(
                f"artifact at {path!r} was made under model fingerprint scheme {scheme} (an earlier jsparse sampled "
                f"the weights differently); this jsparse uses scheme {FINGERPRINT_SCHEME}: make it again with "
                f"{_make_command(kind, path)}")
        raise ArtifactError(
            f"artifact at {path!r} was calibrated for model fingerprint {info['model_fingerprint']!r} "
            f"({info['meta'].get('model', '?')}), but the loaded model's fingerprint is {fingerprint!r}")
    return Artifact(kind=info["kind"], fingerprint=info["model_fingerprint"], arrays=_Arrays(arrays, path, kind),
                    meta=info["meta"])


def text_digest(path: str) -> str:
    """A short sha256 hex digest of a text file's bytes: artifacts record their calibration corpus by it, so an
    evaluation can tell that it is about to score a method on the text it was calibrated on (the same bytes under
    another path, too)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def corpus_meta(paths) -> dict[str, list[str]]:
    """The calibration corpus as artifact metadata: `corpus` (absolute paths) and `corpus_sha256` (`text_digest`)."""
    paths = list(paths)
    return {"corpus": [os.path.abspath(p) for p in paths], "corpus_sha256": [text_digest(p) for p in paths]}


def calibrated_on(path: str, text: str) -> str | None:
    """The calibration corpus file, of the artifact(s) at `path` (one folder, or several joined by os.pathsep), that
    holds the text of file `text`: the same bytes by its recorded `corpus_sha256`, or, for an artifact recorded
    before digests, the same file. None when there is none, or when an artifact records no corpus."""
    digest = text_digest(text)
    real = os.path.realpath(text)
    for folder in (path or "").split(os.pathsep):
        if not folder:
            continue
        try:
            with open(os.path.join(artifact_folder(folder), ARTIFACT_JSON)) as f:
                meta = json.load(f).get("meta", {})
        except (OSError, ValueError, AttributeError):
            continue  # no artifact or a corrupt one: loading it is what reports that
        if not isinstance(meta, dict):
            continue
        corpus, digests = meta.get("corpus") or [], meta.get("corpus_sha256") or []
        for i, c in enumerate(corpus if isinstance(corpus, list) else []):
            same = digests[i] == digest if i < len(digests) else os.path.realpath(str(c)) == real
            if same:
                return str(c)
    return None


def _make_command(kind: str, path: str) -> str:
    """The command that makes an artifact of `kind` at `path` (TokenButler's is trained, the others calibrated)."""
    if kind == "butler":
        return f"`jsparse train-predictor --model M --data FILE --steps N --out {path}`"
    return f"`jsparse calibrate {kind} --model M --out {path}`"


def _json_default(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"not JSON serialisable: {type(x)}")


def artifact_kind(path: str) -> str:
    """The kind recorded in an artifact folder's artifact.json (a relative path found as `artifact_folder` says)."""
    path = artifact_folder(path)
    meta = os.path.join(path, ARTIFACT_JSON)
    if not os.path.exists(meta):
        raise ArtifactError(f"no artifact at {path!r}: {ARTIFACT_JSON} is missing{_moved(path)}")
    try:
        info = _read_info(path)
    except (OSError, ValueError) as e:  # (JSON and UTF-8 errors are ValueErrors)
        raise ArtifactError(f"artifact at {path!r} is corrupt: {type(e).__name__}: {e}") from e
    kind = info.get("kind") if isinstance(info, dict) else None
    if not isinstance(kind, str):
        raise ArtifactError(f"artifact at {path!r} is corrupt: {ARTIFACT_JSON} records no kind (expected an object "
                            "with a \"kind\" string)")
    return kind


def check_artifact_target(out_dir: str, kind: str, writer: str) -> None:
    """ArtifactError when out_dir holds an artifact of another kind than `kind`, which `writer` (what writes there,
    e.g. "calibrate tsa") would replace; none there, or an unreadable artifact.json (an export cut short), passes."""
    try:
        found = artifact_kind(out_dir)
    except ArtifactError:
        return
    if found != kind:
        raise ArtifactError(f"{out_dir!r} holds a {found!r} artifact, which {writer} would replace with its {kind!r} "
                            f"artifact: expected another --out (an empty folder, or a {kind!r} artifact's own)")


def split_artifacts(artifact, kinds: tuple[str, ...]) -> dict[str, str]:
    """Artifact folders by kind from one string of folders separated by os.pathsep (':' on Linux, ';' on
    Windows), or a list / tuple of folders, each routed by the kind in its artifact.json."""
    out: dict[str, str] = {}
    if isinstance(artifact, (list, tuple)):
        paths = list(artifact)
    elif artifact is None or isinstance(artifact, (str, os.PathLike)):
        paths = os.fspath(artifact or "").split(os.pathsep)
    else:
        raise ArtifactError(f"artifact={artifact!r}: expected a folder, folders joined by {os.pathsep!r}, or a list "
                            "of folders")
    for path in paths:
        if not isinstance(path, (str, os.PathLike)):
            raise ArtifactError(f"artifact list entry {path!r}: expected a folder path")
        path = os.fspath(path)
        if not path:
            continue
        kind = artifact_kind(path)
        if kind not in kinds:
            raise ArtifactError(f"artifact at {path!r} is a {kind!r} artifact: expected one of {list(kinds)}")
        if kind in out:
            raise ArtifactError(f"two {kind!r} artifacts given: {out[kind]!r} and {path!r}")
        out[kind] = path
    return out
