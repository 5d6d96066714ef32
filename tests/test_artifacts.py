"""Calibration artifacts are keyed to the model: fingerprints, round trips, and clear errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jsparse.artifacts import Artifact, ArtifactError, load_artifact, model_fingerprint, save_artifact
from models.config import ModelConfig
from models.params import cast, random_params

CFG = ModelConfig(architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8)


def test_fingerprint_is_stable_and_sensitive():
    p = random_params(CFG, jax.random.key(0), jnp.float32)
    fp = model_fingerprint(CFG, p)
    assert fp == model_fingerprint(CFG, p)
    assert fp == model_fingerprint(CFG, cast(p, jnp.bfloat16))  # one checkpoint, two dtypes
    other = p.replace(final_norm=p.final_norm * 2)
    assert model_fingerprint(CFG, other) != fp
    assert model_fingerprint(CFG, random_params(CFG, jax.random.key(1), jnp.float32)) != fp


def test_round_trip_and_mismatch(tmp_path):
    art = Artifact(kind="kascade", fingerprint="abc", arrays={"anchors": np.array([0, 3], np.int32)},
                   meta={"model": "tiny"})
    save_artifact(str(tmp_path / "a"), art)
    got = load_artifact(str(tmp_path / "a"), "kascade", "abc")
    np.testing.assert_array_equal(got.arrays["anchors"], [0, 3])
    with pytest.raises(ArtifactError, match="calibrated for model fingerprint 'abc'.*'xyz'"):
        load_artifact(str(tmp_path / "a"), "kascade", "xyz")
    with pytest.raises(ArtifactError, match="expected 'tsa'"):
        load_artifact(str(tmp_path / "a"), "tsa")
    with pytest.raises(ArtifactError, match="artifact.json is missing"):
        load_artifact(str(tmp_path / "nothing"), "kascade")
    (tmp_path / "a" / "arrays.npz").write_bytes(b"garbage")
    with pytest.raises(ArtifactError, match="corrupt"):
        load_artifact(str(tmp_path / "a"), "kascade")
