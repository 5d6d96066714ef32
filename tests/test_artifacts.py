"""Calibration artifacts are keyed to the model: fingerprints, round trips, and clear errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import json
import os

from jsparse.artifacts import (Artifact, ArtifactError, calibrated_on, load_artifact, model_fingerprint,
                               sample_positions, save_artifact, text_digest)
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


def test_fingerprint_samples_every_head_and_unit():
    """The sampled positions spread over every axis: a plain stride of n // 4096 is a multiple of the row length for
    power-of-two shapes and read one query head of wq and one column of lm_head only. Llama-3.1-8B's shapes (index
    arithmetic only), then a tiny model whose weights change in one query head or one MLP unit at a time."""
    for shape in [(32, 4096, 32, 128), (32, 4096, 8, 128), (32, 4096, 14336), (4096, 128256)]:
        idx = np.unravel_index(sample_positions(int(np.prod(shape))), shape)
        assert len(np.unique(idx[-1])) >= min(shape[-1], 4096) * 0.6, shape
        assert len(np.unique(idx[0])) >= min(shape[0], 1024), shape
        if len(shape) == 4:
            assert len(np.unique(idx[2])) == shape[2]  # every head
    np.testing.assert_array_equal(sample_positions(100), np.arange(100))  # a small leaf: every value
    cfg = ModelConfig(architecture="llama", vocab_size=256, hidden_size=2048, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=4, head_dim=16)
    p = random_params(cfg, jax.random.key(0), jnp.float32)
    fp = model_fingerprint(cfg, p)
    for h in range(cfg.num_heads):
        edited = p.replace(layers=p.layers.replace(wq=p.layers.wq.at[:, :, h, :].multiply(-3.0)))
        assert model_fingerprint(cfg, edited) != fp, h
    edited = p.replace(layers=p.layers.replace(w_down=p.layers.w_down.at[:, 37, :].multiply(-3.0)))
    assert model_fingerprint(cfg, edited) != fp


def test_artifact_of_an_earlier_fingerprint_scheme_says_to_make_it_again(tmp_path):
    save_artifact(str(tmp_path / "a"), Artifact(kind="butler", fingerprint="old", arrays={"x": np.zeros(2)}))
    meta = tmp_path / "a" / "artifact.json"
    info = json.loads(meta.read_text())
    assert info["fingerprint_scheme"] == 2
    del info["fingerprint_scheme"]  # as an artifact written before the scheme was recorded
    meta.write_text(json.dumps(info))
    with pytest.raises(ArtifactError, match="fingerprint scheme 1.*jsparse train-predictor"):
        load_artifact(str(tmp_path / "a"), "butler", "new")


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
    good = (tmp_path / "a" / "arrays.npz").read_bytes()
    (tmp_path / "a" / "arrays.npz").write_bytes(good[:len(good) // 2])  # cut short: zipfile.BadZipFile escaped
    with pytest.raises(ArtifactError, match="corrupt: BadZipFile"):
        load_artifact(str(tmp_path / "a"), "kascade")
    (tmp_path / "a" / "arrays.npz").write_bytes(b"garbage")
    with pytest.raises(ArtifactError, match="corrupt"):
        load_artifact(str(tmp_path / "a"), "kascade")
    save_artifact(str(tmp_path / "a"), art)  # the save writes each file under a temporary name, then renames it
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["arrays.npz", "artifact.json"]
    np.savez(tmp_path / "a" / "arrays.npz", other=np.zeros(2))  # a save cut between its two files
    with pytest.raises(ArtifactError, match=r"lists arrays \['anchors'\], arrays.npz holds \['other'\]"):
        load_artifact(str(tmp_path / "a"), "kascade")


def test_shipped_artifacts_record_their_calibration_text(tmp_path):
    """The shipped artifacts record the digest of the text they were calibrated on (Alice), so an evaluation that
    scores them on it, under any path, is refused (eval.harness.check_calibration_corpus); the default eval text
    (The Call of the Wild) is another."""
    alice = "eval/data/alice_in_wonderland.txt"
    for name in ("kascade", "tsa", "evosparse", "sts"):
        with open(f"artifacts/smollm2/{name}/artifact.json") as f:
            meta = json.load(f)["meta"]
        assert meta["corpus"] == [alice] and meta["corpus_sha256"] == [text_digest(alice)], name
    copy = tmp_path / "renamed.txt"
    with open(alice, "rb") as f:
        copy.write_bytes(f.read())
    both = os.pathsep.join(["artifacts/smollm2/kascade", "artifacts/smollm2/tsa"])  # a composed method's folders
    assert calibrated_on(both, str(copy)) == alice
    assert calibrated_on(both, "eval/data/call_of_the_wild.txt") is None
    assert calibrated_on(str(tmp_path / "no_artifact_here"), str(copy)) is None  # loading it reports that
