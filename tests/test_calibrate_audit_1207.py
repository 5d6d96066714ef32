"""`jsparse calibrate` audit (2026-12-07): bad flags refused by name, value and expected range, before the model
loads where the value alone shows the problem; tiny random models where one is needed."""

import dataclasses
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse
from jsparse.cli import main
from jsparse.methods import evosparse_calibration as ecal
from jsparse.methods import kascade_calibration as kcal
from jsparse.methods import sts_calibration as scal
from jsparse.methods import tsa_calibration as tcal
from models.bundled import LoadedModel
from models.config import ModelConfig
from models.params import random_params

NO_MODEL = "/nonexistent/model.gguf"  # a check that runs after the load would report this file instead
CFG = ModelConfig(architecture="llama", vocab_size=128, hidden_size=32, intermediate_size=48, num_layers=5,
                  num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=512, eos_token_ids=(3,))


class _WordTokenizer:
    """Whitespace words over a fixed vocabulary (1: unknown); no special tokens."""

    def __init__(self, vocab):
        self.vocab = {w: i for i, w in enumerate(vocab)}

    def __call__(self, text, add_special_tokens=True, **_):
        words = text.replace(".", " .").replace("?", " ?").replace(":", " :").split()
        return {"input_ids": [self.vocab.get(w, 1) for w in words]}


def _model(cfg=CFG, tokenizer=None, seed=0):
    return LoadedModel(cfg=cfg, params=random_params(cfg, jax.random.key(seed), jnp.float32, scale=0.3),
                       tokenizer=tokenizer, name="tiny")


def _refused(argv, message, capsys, out):
    assert main(["calibrate", *argv, "--out", str(out)]) == 2, argv
    err = capsys.readouterr().err
    assert message in err, (argv, err)
    assert not out.exists(), argv  # refused before the --out folder was made


@pytest.mark.parametrize("value, message", [
    ("0", "--delta 0: expected the normalised drift rank threshold in (0, 1]"),
    ("1.5", "--delta 1.5: expected the normalised drift rank threshold in (0, 1]"),
    ("nan", "--delta nan: expected the normalised drift rank threshold in (0, 1]")])
def test_tsa_delta_outside_0_1_is_refused_by_flag_before_the_model_loads(value, message, tmp_path, capsys):
    """It was checked after the model loaded, as `delta=0.0` (the Python argument, not the flag)."""
    _refused(["tsa", "--model", NO_MODEL, "--delta", value], message, capsys, tmp_path / "o")


def test_tsa_delta_that_selects_no_layer_is_refused_before_calibrating(monkeypatch):
    """--delta 0.01 on a 30-layer model ran the whole calibration before "selects none of the 30 layers"; the
    layer count is known once the model loads, so the prompts are not run (a delta of exactly 1/L selects one)."""
    model = _model()
    windows = np.asarray(jax.random.randint(jax.random.key(1), (1, 32), 4, CFG.vocab_size))
    with monkeypatch.context() as m:
        m.setattr(tcal, "calibrate", lambda *a, **k: pytest.fail("calibrated with a delta that selects no layer"))
        with pytest.raises(ValueError, match=r"--delta 0.1: selects none of the model's 5 layers .* expected "
                                             r"--delta >= 1/5 = 0.2000"):
            tcal.run_cli(model, windows, SimpleNamespace(delta=0.1))
    art = tcal.run_cli(model, windows, SimpleNamespace(delta=0.2))
    assert len(art.meta["sparse_layers"]) == 1


@pytest.mark.parametrize("extra, message", [
    (["--needle-words", "0"], "--needle-words 0: expected between 1 and 60"),
    (["--needle-words", "61"], "--needle-words 61: expected between 1 and 60"),
    (["--min-recall", "0"], "--min-recall 0: expected a fraction in (0, 1]"),
    (["--min-recall", "1.5"], "--min-recall 1.5: expected a fraction in (0, 1]"),
    (["--depths", "0.5,1.5"], "--depths value 1.5: expected fractions in [0, 1]"),
    (["--depths", "nan"], "--depths value nan: expected fractions in [0, 1]"),
    (["--depths", "x"], "--depths 'x': expected comma-separated fractions in [0, 1]"),
    (["--prompt-lengths", "32"], "--prompt-lengths value 32: expected between 64 and --length 2048"),
    (["--prompt-lengths", "4096"], "--prompt-lengths value 4096: expected between 64 and --length 2048"),
    (["--prompt-lengths", "abc"], "--prompt-lengths 'abc': expected comma-separated integers"),
    (["--length", "100"], "--length 100: the default needle prompts are --length/2 and --length tokens")])
def test_evosparse_flags_are_refused_by_name_before_the_model_loads(extra, message, tmp_path, capsys):
    """Every one of these was checked only once the model had loaded (the needle words and recall as the Python
    arguments `needle_words=0`, `min_recall=0.0`, a depth as `depth 1.5`)."""
    _refused(["evosparse", "--model", NO_MODEL, *extra], message, capsys, tmp_path / "o")


@pytest.mark.filterwarnings("ignore:no needle prompt")  # (a random model copies no needle)
def test_evosparse_needle_prompt_past_the_context_is_refused_before_any_run(monkeypatch):
    """A prompt as long as the context (the default prompt lengths at --length 8192 on smollm2) decoded its needle
    past the model's context, RoPE extrapolating without a word (the decode runs traced: no check fires). Refused
    with the longest length that fits, before any prompt runs."""
    cfg = dataclasses.replace(CFG, max_position_embeddings=128)
    model = _model(cfg, _WordTokenizer(["<pad>", "<unk>"] + list(ecal.WORDS)))
    windows = np.asarray(jax.random.randint(jax.random.key(2), (1, 128), 4, cfg.vocab_size))
    monkeypatch.setattr(ecal, "copy_run", lambda *a, **k: pytest.fail("ran a prompt before refusing another"))
    # The word tokenizer gives 4 needle words 4 tokens: the last decoded from position 128 + 4 - 2 = 130.
    with pytest.raises(ValueError, match=r"needle prompt length=128 .* the 4 needle tokens decoded after it pass "
                                         r"the model's context of 128 tokens: expected lengths <= 125"):
        ecal.calibrate(model, windows, lengths=[64, 128], depths=[0.5], needle_words=4)
    monkeypatch.undo()
    art = ecal.calibrate(model, windows, lengths=[125], depths=[0.5], needle_words=4)  # the longest that fits
    assert art.meta["lengths"] == [125]


@pytest.mark.parametrize("extra, message", [
    (["--k", "abc"], "--k 'abc': expected comma-separated token counts like 64,256"),
    (["--k", "64,0"], "--k '64,0': expected token counts >= 1"),
    (["--k", "8", "--tile", "0"], "--tile 0: tile=0: expected an integer >= 1"),
    (["--k", "8", "--tile", "48"], "--tile 48: tile=48 does not divide the prefill kernel's query block"),
    (["--length", "200"], "--length 200: too short for --k 256 with --tile 32 (top-k is a choice only in tiles "
                          "past k keys): expected --length > k + tile = 288")])
def test_sts_flags_are_refused_by_name_before_the_models_load(extra, message, tmp_path, capsys):
    """These came after loading the target and the draft (--k 0 as `k=[0]`, the tile as `tile=0`, the length
    once both models had loaded)."""
    _refused(["sts", "--model", NO_MODEL, "--draft", NO_MODEL, *extra], message, capsys, tmp_path / "o")


def test_sts_length_past_the_drafts_context_is_refused(monkeypatch):
    """The CLI checks --length against the target's context only; the draft's prefill of a longer prompt ran on
    extrapolated RoPE without a word."""
    draft_cfg = dataclasses.replace(CFG, num_layers=2, max_position_embeddings=64)
    draft = _model(draft_cfg, seed=1)
    import models.bundled

    monkeypatch.setattr(models.bundled, "load_model", lambda spec, dtype=None: draft)
    monkeypatch.setattr(scal, "calibrate", lambda *a, **k: pytest.fail("calibrated past the draft's context"))
    windows = np.asarray(jax.random.randint(jax.random.key(3), (1, 96), 4, CFG.vocab_size))
    with pytest.raises(ValueError, match=r"--length 96: expected at most the draft's context of 64 tokens "
                                         r"\(--draft small\)"):
        scal.run_cli(_model(), windows, SimpleNamespace(k="8", tile=16, draft="small"))


@pytest.mark.parametrize("extra, message", [
    (["--tile", "0"], "--tile 0: tile=0: expected an integer >= 1"),
    (["--tile", "48"], "--tile 48: tile=48 does not divide"),
    (["--length", "64"], "--length 64: no query tile's top-k leaves a key out at --budget 0.1 (k = max(ceil(budget "
                         "* n), 128) of a tile's n keys, --tile 32), so every similarity would be 1 and the anchors "
                         "[0]; expected --length >= 161"),
    (["--length", "2048", "--budget", "0.99999999"], "expected a lower --budget")])
def test_kascade_tile_and_too_short_length_are_refused_by_flag_before_the_model_loads(extra, message, tmp_path,
                                                                                      capsys):
    """--length 64 loaded the model before the calibration said its prompts were too short; --tile was named as
    the Python argument `tile=0`. A budget whose f32 is 1 keeps every key at any length."""
    _refused(["kascade", "--model", NO_MODEL, *extra], message, capsys, tmp_path / "o")


def test_kascade_shortest_length_is_exact():
    """The length the message asks for is the first that calibrate accepts (161 at the defaults: the tile at 160
    has 160 keys before it, of which k = 128 are kept)."""
    args = dict(anchors=None, target_share=None, reuse_scale=2.0, budget=0.1, tile=32)
    kcal.check_cli(SimpleNamespace(length=161, **args))
    with pytest.raises(ValueError, match="--length 160: .* expected --length >= 161"):
        kcal.check_cli(SimpleNamespace(length=160, **args))
    assert kcal.shortest_prompt(0.1, 16, 8) == 17  # (a tile at 16 keeps 8 of its 16 keys)


def test_out_folder_of_other_files_is_refused_and_left_alone(tmp_path, capsys):
    """A non-empty folder that holds no artifact (a results folder, a parent of artifacts, the repository) got
    artifact.json and arrays.npz written among its files; an empty folder or an artifact's own still passes (to
    the model's load here)."""
    out = tmp_path / "results"
    out.mkdir()
    for name in ("results.json", "summary.md", "a.png", "b.png"):
        (out / name).write_text("x")
    assert main(["calibrate", "tsa", "--model", NO_MODEL, "--out", str(out)]) == 2
    assert (f"--out '{out}' is a folder holding other files than an artifact (a.png, b.png, results.json and 1 "
            "more): expected a new or empty folder") in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["a.png", "b.png", "results.json", "summary.md"]
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / ".gitkeep").write_text("")  # a hidden file is no content
    own = tmp_path / "own"
    own.mkdir()
    (own / "artifact.json").write_text('{"kind": "tsa"}')
    (own / "notes.txt").write_text("x")
    for folder in (empty, own):
        assert main(["calibrate", "tsa", "--model", NO_MODEL, "--out", str(folder)]) == 2
        assert f"'{NO_MODEL}' does not exist" in capsys.readouterr().err


def test_corpus_too_short_names_the_flags(tmp_path, monkeypatch, capsys):
    """A corpus shorter than one --length window said "use a longer corpus or a shorter length" without naming
    the corpus or the flags (the message of perplexity's windows)."""
    words = ["<pad>", "<unk>", "the", "cat", "sat", "."]
    model = _model(tokenizer=_WordTokenizer(words))
    monkeypatch.setattr(jsparse, "load", lambda spec, dtype=None, **_: model)
    corpus = tmp_path / "short.txt"
    corpus.write_text("the cat sat. " * 10)  # 40 tokens
    out = tmp_path / "o"
    assert main(["calibrate", "tsa", "--corpus", str(corpus), "--length", "64", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--corpus {corpus} with --length 64 and --samples 4: the corpus has 40 tokens, fewer than the 64" in err
    assert not out.exists()


@pytest.mark.parametrize("content, message", [
    (b"", "is empty"), (b"text\x00\x00\x00", "holds a NUL character (at character 4)"),
    (None, "does not exist or is not a file")])
def test_corpus_missing_empty_or_binary_is_refused_before_the_model_loads(content, message, tmp_path, capsys):
    corpus = tmp_path / "c.txt"
    if content is not None:
        corpus.write_bytes(content)
    _refused(["tsa", "--model", NO_MODEL, "--corpus", str(corpus)], message, capsys, tmp_path / "o")
