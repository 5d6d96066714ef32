"""Calibration artifacts: small files keyed by a fingerprint of the model they were made for.

An artifact is a folder holding `artifact.json` (kind, model fingerprint, model name, metadata) and
`arrays.npz` (the calibrated arrays). Loading an artifact for a model whose fingerprint differs is an error.

The fingerprint hashes the model config and a strided sample of every weight tensor (4096 values per leaf,
taken on the device and rounded to bf16, so the f32 and bf16 loads of one checkpoint agree), so it is cheap for
an 8B checkpoint yet changes when any tensor is replaced.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from models.params import Slice, projection_views

ARTIFACT_JSON = "artifact.json"
ARRAYS_NPZ = "arrays.npz"
_SAMPLES_PER_LEAF = 4096


class ArtifactError(ValueError):
    """An artifact that is missing, corrupt, of the wrong kind, or made for another model."""


def model_fingerprint(cfg: ModelConfig, params: Any) -> str:
    """A short hex digest of the config and a strided sample of every weight."""
    h = hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True).encode())
    # The separate q/k/v and gate/up layout's leaves, read in place from fused params: one fingerprint for both.
    for path, leaf in jax.tree_util.tree_leaves_with_path(projection_views(params)):
        shape = tuple(leaf.shape)
        n = int(np.prod(shape))
        stride = max(1, n // _SAMPLES_PER_LEAF)
        index = list(np.unravel_index(np.arange(0, n, stride)[:_SAMPLES_PER_LEAF], shape))
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


def save_artifact(path: str, artifact: Artifact) -> None:
    os.makedirs(path, exist_ok=True)
    info = {"kind": artifact.kind, "model_fingerprint": artifact.fingerprint,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "arrays": sorted(artifact.arrays), "meta": artifact.meta}
    np.savez(os.path.join(path, ARRAYS_NPZ), **artifact.arrays)
    with open(os.path.join(path, ARTIFACT_JSON), "w") as f:
        json.dump(info, f, indent=2, default=_json_default)


def load_artifact(path: str, kind: str, fingerprint: str | None = None) -> Artifact:
    """Loads an artifact of `kind`; with `fingerprint`, raises ArtifactError if it was made for another model."""
    meta_path = os.path.join(path, ARTIFACT_JSON)
    if not os.path.exists(meta_path):
        raise ArtifactError(f"no artifact at {path!r}: {ARTIFACT_JSON} is missing (make one with "
                            f"`jsparse calibrate {kind} --model M --out {path}`)")
    try:
        with open(meta_path) as f:
            info = json.load(f)
        with np.load(os.path.join(path, ARRAYS_NPZ), allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (OSError, ValueError, json.JSONDecodeError) as e:
        raise ArtifactError(f"artifact at {path!r} is corrupt: {e}") from e
    if info.get("kind") != kind:
        raise ArtifactError(f"artifact at {path!r} is a {info.get('kind')!r} artifact, expected {kind!r}")
    if fingerprint is not None and info.get("model_fingerprint") != fingerprint:
        raise ArtifactError(
            f"artifact at {path!r} was calibrated for model fingerprint {info.get('model_fingerprint')!r} "
            f"({info.get('meta', {}).get('model', '?')}), but the loaded model's fingerprint is {fingerprint!r}")
    return Artifact(kind=info["kind"], fingerprint=info["model_fingerprint"], arrays=arrays,
                    meta=info.get("meta", {}))


def _json_default(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"not JSON serialisable: {type(x)}")


def artifact_kind(path: str) -> str:
    """The kind recorded in an artifact folder's artifact.json."""
    meta = os.path.join(path, ARTIFACT_JSON)
    if not os.path.exists(meta):
        raise ArtifactError(f"no artifact at {path!r}: {ARTIFACT_JSON} is missing")
    try:
        with open(meta) as f:
            return str(json.load(f).get("kind"))
    except (OSError, json.JSONDecodeError) as e:
        raise ArtifactError(f"artifact at {path!r} is corrupt: {e}") from e


def split_artifacts(artifact: str | None, kinds: tuple[str, ...]) -> dict[str, str]:
    """Artifact folders by kind from one string of folders separated by os.pathsep (':' on Linux, ';' on
    Windows), each routed by the kind in its artifact.json."""
    out: dict[str, str] = {}
    for path in (artifact or "").split(os.pathsep):
        if not path:
            continue
        kind = artifact_kind(path)
        if kind not in kinds:
            raise ArtifactError(f"artifact at {path!r} is a {kind!r} artifact: expected one of {list(kinds)}")
        if kind in out:
            raise ArtifactError(f"two {kind!r} artifacts given: {out[kind]!r} and {path!r}")
        out[kind] = path
    return out
