"""Calibration artifacts are keyed to the model: fingerprints, round trips, and clear errors."""

import hashlib
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
        with open(f"jsparse/shipped/smollm2/{name}/artifact.json") as f:
            meta = json.load(f)["meta"]
        assert meta["corpus"] == [alice] and meta["corpus_sha256"] == [text_digest(alice)], name
    copy = tmp_path / "renamed.txt"
    with open(alice, "rb") as f:
        copy.write_bytes(f.read())
    both = os.pathsep.join(["jsparse/shipped/smollm2/kascade", "jsparse/shipped/smollm2/tsa"])  # a composed method's folders
    assert calibrated_on(both, str(copy)) == alice
    assert calibrated_on(both, "eval/data/call_of_the_wild.txt") is None
    assert calibrated_on(str(tmp_path / "no_artifact_here"), str(copy)) is None  # loading it reports that


def test_a_save_interrupted_between_its_files_is_refused_not_read_as_the_other_model(tmp_path):
    """artifact.json records the sha256 of arrays.npz and is written first: a save of model B's calibration over model
    A's, cut between the two renames, leaves B's metadata beside A's arrays, which loads as neither. Arrays with the
    same names (two calibrations of one kind) are caught by the digest, not by the names."""
    path = str(tmp_path / "a")
    save_artifact(path, Artifact(kind="kascade", fingerprint="fp-A", arrays={"anchors": np.array([0, 1], np.int32)}))
    old = (tmp_path / "a" / "arrays.npz").read_bytes()
    save_artifact(path, Artifact(kind="kascade", fingerprint="fp-B", arrays={"anchors": np.array([0, 2], np.int32)}))
    assert json.loads((tmp_path / "a" / "artifact.json").read_text())["arrays_sha256"]
    (tmp_path / "a" / "arrays.npz").write_bytes(old)  # the new artifact.json is in place, the arrays not yet
    for fp in ("fp-A", "fp-B", None):
        with pytest.raises(ArtifactError, match="not the file artifact.json was saved with"):
            load_artifact(path, "kascade", fp)
    info = json.loads((tmp_path / "a" / "artifact.json").read_text())
    del info["arrays_sha256"]  # an artifact saved before the digest: loads as it did
    (tmp_path / "a" / "artifact.json").write_text(json.dumps(info))
    assert load_artifact(path, "kascade").arrays["anchors"].tolist() == [0, 1]


def test_a_save_cut_short_leaves_no_temporary_file(tmp_path, monkeypatch):
    """An interrupt while the arrays are written (a predictor's can be hundreds of MB) takes the half-written
    arrays.npz.tmp away; what is left is refused by its digest, as a save cut between its renames is."""
    path = str(tmp_path / "a")
    save_artifact(path, Artifact(kind="kascade", fingerprint="fp-A", arrays={"anchors": np.array([0, 1], np.int32)}))
    real_replace = os.replace

    def interrupted(src, dst):
        if src.endswith("arrays.npz.tmp"):
            raise KeyboardInterrupt
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_artifact(path, Artifact(kind="kascade", fingerprint="fp-A",
                                     arrays={"anchors": np.array([0, 2], np.int32)}))
    monkeypatch.setattr(os, "replace", real_replace)
    assert sorted(os.listdir(path)) == ["arrays.npz", "artifact.json"]
    with pytest.raises(ArtifactError, match="not the file artifact.json was saved with"):
        load_artifact(path, "kascade")


def test_corrupt_or_hand_edited_artifacts_are_artifact_errors_naming_the_field(tmp_path):
    from jsparse.artifacts import artifact_kind, update_artifact_meta

    path = str(tmp_path / "a")
    save_artifact(path, Artifact(kind="kascade", fingerprint="fp", arrays={"anchors": np.array([0, 1], np.int32)},
                                 meta={"model": "tiny"}))
    meta_file = tmp_path / "a" / "artifact.json"
    good = json.loads(meta_file.read_text())
    for edit, match in ((lambda d: d.pop("model_fingerprint"), "model_fingerprint=None, expected a string"),
                        (lambda d: d.update(meta=None), "meta=None, expected an object"),
                        (lambda d: d.update(meta=[1]), r"meta=\[1\], expected an object"),
                        (lambda d: d.pop("arrays"), "arrays=None, expected a list of names"),
                        (lambda d: d.pop("kind"), "kind=None, expected a string")):
        info = json.loads(json.dumps(good))
        edit(info)
        meta_file.write_text(json.dumps(info))
        with pytest.raises(ArtifactError, match=match):
            load_artifact(path, "kascade", "other")
    meta_file.write_text(json.dumps({**good, "kind": None}))
    with pytest.raises(ArtifactError, match="records no kind"):
        artifact_kind(path)
    meta_file.write_bytes(b"\xff\xfe{")
    for call in (lambda: load_artifact(path, "kascade"), lambda: artifact_kind(path)):
        with pytest.raises(ArtifactError, match="corrupt: UnicodeDecodeError"):
            call()
    meta_file.write_text(json.dumps({**good, "meta": None}))
    assert calibrated_on(path, "eval/data/call_of_the_wild.txt") is None  # loading it is what reports that
    meta_file.write_text(json.dumps(good))
    with pytest.raises(ArtifactError, match=r"has no array 'head_map' \(it holds \['anchors'\]\).*jsparse calibrate"):
        load_artifact(path, "kascade").arrays["head_map"]
    art = update_artifact_meta(path, "kascade", dense_set=[1])  # the metadata rewritten, the digest kept
    assert art.meta == {"model": "tiny", "dense_set": [1]} == load_artifact(path, "kascade", "fp").meta
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["arrays.npz", "artifact.json"]


def test_method_artifacts_of_another_shape_or_with_float_indices_are_refused(tmp_path):
    """Index arrays are refused in a float dtype (a cast would truncate 1.9 to 1); a TSA artifact's per-layer arrays
    must have this model's layer count; an STS artifact's ks must match its head maps; Kascade's reuse_scale must be
    a number."""
    from jsparse.methods import make_method
    from jsparse.methods.sts import load_head_map
    from jsparse.methods.tsa import load_sparse_layers

    cfg = ModelConfig(architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4,
                      num_heads=4, num_kv_heads=2, head_dim=8)
    tsa = lambda **a: save_artifact(str(tmp_path / "tsa"), Artifact(kind="tsa", fingerprint="fp", arrays={  # noqa: E731
        "sparse_layers": np.array([1, 2], np.int32), "drift": np.zeros(4, np.float32),
        "normalized_rank": np.zeros(4, np.float32), **a}))
    tsa()
    assert load_sparse_layers(str(tmp_path / "tsa"), None, cfg) == (1, 2)
    tsa(drift=np.zeros(30, np.float32))
    with pytest.raises(ArtifactError, match=r"drift of shape \(30,\): expected \(4,\)"):
        load_sparse_layers(str(tmp_path / "tsa"), None, cfg)
    tsa(sparse_layers=np.array([1.0, 2.7], np.float32))
    with pytest.raises(ValueError, match="expected integer layer indices"):
        load_sparse_layers(str(tmp_path / "tsa"), None, cfg)

    hm = np.full((4, 2), 1.9, np.float32)
    save_artifact(str(tmp_path / "k"), Artifact(kind="kascade", fingerprint="fp", arrays={
        "anchors": np.array([0, 2], np.int32), "head_map": hm}))
    with pytest.raises(ValueError, match="head_map of the artifact at .* has dtype float32: expected integers"):
        make_method("kascade", cfg=cfg, artifact=str(tmp_path / "k"))
    save_artifact(str(tmp_path / "k"), Artifact(kind="kascade", fingerprint="fp", arrays={
        "anchors": np.array([0, 2], np.int32), "head_map": hm.astype(np.int32)}, meta={"reuse_scale": None}))
    with pytest.raises(ArtifactError, match="reuse_scale=None, expected a number"):
        make_method("kascade", cfg=cfg, artifact=str(tmp_path / "k"))
    # The tile and min_tokens of the calibration are the method's, unless given (the defaults 32 and 128 ran before).
    save_artifact(str(tmp_path / "k"), Artifact(kind="kascade", fingerprint="fp", arrays={
        "anchors": np.array([0, 2], np.int32), "head_map": hm.astype(np.int32)}, meta={"tile": 16, "min_tokens": 8}))
    built = make_method("kascade", cfg=cfg, artifact=str(tmp_path / "k"))
    assert (built.tile, built.min_tokens) == (16, 8)
    given = make_method("kascade", cfg=cfg, artifact=str(tmp_path / "k"), tile=32, min_tokens=64)
    assert (given.tile, given.min_tokens) == (32, 64)
    save_artifact(str(tmp_path / "k"), Artifact(kind="kascade", fingerprint="fp", arrays={
        "anchors": np.array([0, 2], np.int32), "head_map": hm.astype(np.int32)}, meta={"tile": 16.5}))
    with pytest.raises(ArtifactError, match="meta tile=16.5, expected an integer"):
        make_method("kascade", cfg=cfg, artifact=str(tmp_path / "k"))

    maps = np.zeros((2, 4, 4, 2), np.int32)
    for arrays, meta, match in (({"ks": np.array([8, 16, 32]), "head_maps": maps}, {}, r"ks \[8, 16, 32\]"),
                                ({"ks": np.array([], np.int32), "head_maps": maps[:0]}, {}, r"ks \[\]"),
                                ({"ks": np.array([0, 16]), "head_maps": maps}, {}, r"ks \[0, 16\]"),
                                ({"ks": np.array([8, 16]), "head_maps": maps}, {"length": "long"},
                                 "meta length='long'"),
                                ({"ks": np.array([8, 16]), "head_maps": maps.astype(np.float32)}, {},
                                 "dtype float32: expected integers")):
        save_artifact(str(tmp_path / "s"), Artifact(kind="sts", fingerprint="fp", arrays=arrays,
                                                    meta={"draft_fingerprint": "d", **meta}))
        with pytest.raises(ValueError, match=match):
            load_head_map(str(tmp_path / "s"), "fp", "d", 0.5)


def test_a_hand_edited_predictor_config_is_named():
    """TokenButler's artifact stores its predictor's config: a missing field, a non-number or a non-positive epsilon
    or theta is a PredictorConfigError (a ValueError) naming it, not a TypeError from the dataclass."""
    import dataclasses

    from jsparse.methods.butler_predictor import PredictorConfig, PredictorConfigError

    full = dataclasses.asdict(PredictorConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, down_dim=16,
                                              attn_heads=2, ffn_dim=32, qk_hidden=16, head_dim=8, key_heads=4))
    required = [f.name for f in dataclasses.fields(PredictorConfig) if f.default is dataclasses.MISSING]
    assert PredictorConfig.from_dict(full) == PredictorConfig(**full)
    for d, match in (({k: v for k, v in full.items() if k != required[0]}, rf"lacks \['{required[0]}'\]"),
                     ({**full, "rope_theta": "x"}, "rope_theta='x': expected a positive number"),
                     ({**full, "ln_eps": -1}, "ln_eps=-1: expected a positive number"),
                     ({**full, required[0]: float("inf")}, "expected a whole number"),
                     (None, "expected an object of fields")):
        with pytest.raises(PredictorConfigError, match=match):
            PredictorConfig.from_dict(d)


def test_shipped_artifacts_are_found_from_any_working_directory(tmp_path, monkeypatch):
    """`shipped_artifact` names the bundled model's artifacts inside the package; a relative artifact path that is
    no folder here is looked up where jsparse is installed, one that is a folder here wins, and an unknown shipped
    kind is refused naming those there are."""
    import jsparse
    from jsparse.artifacts import ArtifactError, artifact_folder, artifact_kind, load_artifact

    path = jsparse.shipped_artifact("kascade")
    assert os.path.isabs(path) and os.path.isfile(os.path.join(path, "artifact.json"))
    monkeypatch.chdir(tmp_path)
    assert artifact_folder("jsparse/shipped/smollm2/kascade") == path.replace("/", os.sep)
    assert load_artifact("jsparse/shipped/smollm2/tsa", "tsa").kind == "tsa"
    assert artifact_kind("jsparse/shipped/smollm2/sts") == "sts"
    (tmp_path / "jsparse" / "shipped" / "smollm2" / "kascade").mkdir(parents=True)  # a folder here wins
    with pytest.raises(ArtifactError, match="no artifact at 'jsparse/shipped/smollm2/kascade'"):
        load_artifact("jsparse/shipped/smollm2/kascade", "kascade")
    with pytest.raises(ArtifactError, match="no artifact at 'elsewhere/kascade'") as e:
        load_artifact("elsewhere/kascade", "kascade")
    assert "moved" not in str(e.value)
    with pytest.raises(ArtifactError, match=r"moved from artifacts/<model>/<kind> to jsparse/shipped/<model>/<kind> "
                                            r"\(jsparse.shipped_artifact\('tsa'\)\)"):
        artifact_kind("artifacts/smollm2/tsa")  # where they were before 2026-12-05
    with pytest.raises(ArtifactError, match=r"no shipped 'quest' artifact for model 'smollm2': expected one of "
                                            r"\['smollm2/butler', 'smollm2/evosparse', 'smollm2/kascade', "
                                            r"'smollm2/sts', 'smollm2/tsa'\]"):
        jsparse.shipped_artifact("quest")


def test_sample_positions_are_every_position_up_to_the_sample_count_then_the_distinct_golden_ratio_floors():
    """The docstring's definition, in Python floats: every position while n <= 4096 (n = 4096 included), else the
    ascending distinct floor(n * frac(i * phi)) for i < 4096, which reaches the last position n - 1 for n near 4096."""
    np.testing.assert_array_equal(sample_positions(4096), np.arange(4096))
    phi = (math.sqrt(5) - 1) / 2
    for n in (4097, 5000, 123457):
        want = sorted({math.floor(n * math.modf(i * phi)[0]) for i in range(4096)})
        got = sample_positions(n)
        assert got.dtype == np.int64 and got.tolist() == want, n
    assert sample_positions(4097)[-1] == 4096


def test_numpy_metadata_round_trips_and_update_replaces_a_key(tmp_path):
    """Calibrators record numpy scalars and arrays as metadata: they load back as JSON numbers and lists; and
    `update_artifact_meta` replaces an existing key ("Adds or replaces"), keeping the others."""
    from jsparse.artifacts import update_artifact_meta

    path = str(tmp_path / "a")
    save_artifact(path, Artifact(kind="kascade", fingerprint="fp", arrays={"anchors": np.array([0, 1], np.int32)},
                                 meta={"tile": np.int64(16), "share": np.float32(0.5),
                                       "dense_set": np.array([3, 7], np.int32), "model": "tiny"}))
    meta = load_artifact(path, "kascade", "fp").meta
    assert meta == {"tile": 16, "share": 0.5, "dense_set": [3, 7], "model": "tiny"}
    assert type(meta["tile"]) is int
    art = update_artifact_meta(path, "kascade", tile=32)
    assert art.meta["tile"] == 32 == load_artifact(path, "kascade", "fp").meta["tile"]
    assert load_artifact(path, "kascade", "fp").meta["dense_set"] == [3, 7]


def test_hand_edited_or_truncated_artifacts_name_what_is_wrong(tmp_path):
    """An arrays list naming an array the file lacks, an artifact.json that is not an object, an empty arrays.npz,
    and the mismatch message names the model the artifact was made for."""
    from jsparse.artifacts import artifact_kind

    path = str(tmp_path / "a")
    save_artifact(path, Artifact(kind="kascade", fingerprint="abc", arrays={"anchors": np.array([0, 1], np.int32)},
                                 meta={"model": "tiny"}))
    with pytest.raises(ArtifactError, match=r"calibrated for model fingerprint 'abc' \(tiny\), but the loaded "
                                            r"model's fingerprint is 'xyz'"):
        load_artifact(path, "kascade", "xyz")
    meta_file = tmp_path / "a" / "artifact.json"
    good = json.loads(meta_file.read_text())
    meta_file.write_text(json.dumps({**good, "arrays": ["anchors", "head_map"]}))  # the digest still matches
    with pytest.raises(ArtifactError, match=r"lists arrays \['anchors', 'head_map'\], arrays.npz holds \['anchors'\]"):
        load_artifact(path, "kascade")
    meta_file.write_text("[1, 2]")
    with pytest.raises(ArtifactError, match="artifact.json holds a list, expected an object"):
        load_artifact(path, "kascade")
    with pytest.raises(ArtifactError, match="records no kind"):
        artifact_kind(path)
    meta_file.write_text(json.dumps(good))
    (tmp_path / "a" / "arrays.npz").write_bytes(b"")  # a zero-byte file (a crash before any byte was written)
    with pytest.raises(ArtifactError, match="corrupt: EOFError"):
        load_artifact(path, "kascade")


def test_meta_number_refuses_a_boolean():
    """True is an int to Python, not a number of a calibration: refused as integer and as number."""
    from jsparse.artifacts import meta_number

    art = Artifact(kind="kascade", fingerprint="fp", arrays={}, meta={"tile": True, "scale": False})
    with pytest.raises(ArtifactError, match="meta tile=True, expected an integer"):
        meta_number(art, "/a", "tile", integer=True)
    with pytest.raises(ArtifactError, match="meta scale=False, expected a number"):
        meta_number(art, "/a", "scale")


def test_a_shipped_folder_without_artifact_json_is_not_an_artifact(tmp_path, monkeypatch):
    """A kind folder left without its artifact.json is refused, and not listed among those there are."""
    from jsparse import artifacts

    root = tmp_path / "jsparse" / "shipped" / "smollm2"
    (root / "quest").mkdir(parents=True)
    (root / "kascade").mkdir()
    (root / "kascade" / "artifact.json").write_text("{}")
    monkeypatch.setattr(artifacts, "INSTALL_ROOT", str(tmp_path))
    assert artifacts.shipped_artifact("kascade") == str(root / "kascade")
    with pytest.raises(ArtifactError, match=r"no shipped 'quest' artifact for model 'smollm2': expected one of "
                                            r"\['smollm2/kascade'\]"):
        artifacts.shipped_artifact("quest")


def test_calibrated_on_skips_missing_folders_and_matches_old_artifacts_by_path(tmp_path, monkeypatch):
    """Several folders (an empty or missing one skipped, not ending the search), a shipped folder named relative to
    the install from another directory, an artifact from before digests matched by its file's path; and
    `text_digest` hashes a file of several read blocks whole, `corpus_meta` records absolute paths."""
    from jsparse.artifacts import corpus_meta

    alice = os.path.abspath("eval/data/alice_in_wonderland.txt")
    monkeypatch.chdir(tmp_path)
    shipped = "jsparse/shipped/smollm2/kascade"
    assert calibrated_on(shipped, alice) == "eval/data/alice_in_wonderland.txt"
    assert calibrated_on(os.pathsep.join(["", str(tmp_path / "missing"), shipped]), alice) \
        == "eval/data/alice_in_wonderland.txt"
    text = tmp_path / "dev.txt"
    text.write_text("dev text\n" * 10)
    old = str(tmp_path / "old")
    save_artifact(old, Artifact(kind="kascade", fingerprint="fp", arrays={"a": np.zeros(1)},
                                meta={"corpus": [str(text)]}))  # no corpus_sha256
    assert calibrated_on(old, "dev.txt") == str(text)
    assert calibrated_on(old, alice) is None
    big = tmp_path / "big.txt"
    data = os.urandom(3 * (1 << 20) + 5)
    big.write_bytes(data)
    assert text_digest(str(big)) == hashlib.sha256(data).hexdigest()[:16]
    assert corpus_meta(["dev.txt"]) == {"corpus": [str(text)],
                                        "corpus_sha256": [hashlib.sha256(text.read_bytes()).hexdigest()[:16]]}
