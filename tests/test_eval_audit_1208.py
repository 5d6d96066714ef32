"""Bad input to `jsparse eval`, `jsparse demo` and `python -m eval.butler_eval` (audit of 2026-12-08): each is
refused with a message naming the value and what was expected, and every check that needs no model runs before
the model loads (`jsparse.load` fails the test where it must not be reached)."""

from __future__ import annotations

import os
import tempfile
import types

import pytest

import jsparse
from eval import butler_eval, harness, passkey, ppl
from jsparse.cli import main
from models.config import ModelConfig


class Loaded(Exception):
    """Raised by the patched `jsparse.load`: the command got as far as loading the model."""


@pytest.fixture
def no_load(monkeypatch):
    def load(*a, **k):
        raise AssertionError("the model must not be loaded when the arguments are invalid")

    monkeypatch.setattr(jsparse, "load", load)


@pytest.fixture
def stop_at_load(monkeypatch):
    def load(*a, **k):
        raise Loaded

    monkeypatch.setattr(jsparse, "load", load)


def _refused(argv, capsys) -> str:
    assert main(argv) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["--depths", "0.1,0.5,0.50"], "passkey depths [0.1, 0.5, 0.5] name depth 0.5 twice: expected each depth once"),
    (["--ppl-variants", "decode,prefill,decode"],
     "perplexity variants ['decode', 'prefill', 'decode'] name a variant twice: expected each once"),
    (["--methods", "dense", "--method-option", "dense.x=1"],
     "--method-option dense.x=1: method 'dense' has no option 'x'; its options are artifact, budget"),
    (["--methods", "oracle", "--method-option", "oracle.nosuch=1"], "method 'oracle' has no option 'nosuch'"),
    (["--methods", "butler", "--method-option", "butler.rebalance=False"],
     "method 'butler' option rebalance='False': expected true or false"),
    (["--methods", "kascade", "--method-option", "kascade.artifact=/elsewhere"],
     "--method-option kascade.artifact='/elsewhere': the artifact is given by --artifact"),
    (["--methods", "sts", "--draft", "smollm2", "--ppl-variants", "prefill", "--method-option", "sts.draft=other"],
     "--method-option sts.draft='other': the draft is given by --draft"),
])
def test_eval_refuses_before_the_model_loads(extra, message, no_load, tmp_path, capsys):
    err = _refused(["eval", "--out", str(tmp_path / "run"), "--no-progress", *extra], capsys)
    assert message in err
    assert not os.path.exists(tmp_path / "run")  # a refused run leaves no empty folder


def test_check_functions_refuse_repeats_and_keep_distinct_values():
    with pytest.raises(ValueError, match=r"name depth 0.3 twice"):
        passkey.check_depths([0.3, 0.7, 0.3])
    assert passkey.check_depths([0.0, 0.5, 1.0]) == (0.0, 0.5, 1.0)
    with pytest.raises(ValueError, match=r"name a variant twice"):
        ppl.check_variants(("continuation", "continuation"))
    assert ppl.check_variants(("decode", "continuation")) == ("decode", "continuation")
    # EvalSpec.validate (what `harness.evaluate` runs) refuses them too, and a repeated variant is not two units.
    base = dict(methods=("dense",), tasks=("passkey", "ppl"), lengths=(64,))
    with pytest.raises(ValueError, match="name depth 0.5 twice"):
        harness.EvalSpec(**base, depths=(0.5, 0.5)).validate()
    with pytest.raises(ValueError, match="name a variant twice"):
        harness.EvalSpec(**base, ppl_variants=("prefill", "prefill")).validate()
    with pytest.raises(ValueError, match="the artifact is given by --artifact"):
        harness.EvalSpec(methods=("kascade",), method_options={"kascade": {"artifact": "K"}}).validate()
    assert harness.EvalSpec(methods=("oracle",), method_options={"oracle": {"min_tokens": 4}}).validate()


@pytest.mark.parametrize("command", ["eval", "demo"])
def test_an_out_folder_that_takes_no_file_is_refused_before_the_run(command, no_load, tmp_path, capsys,
                                                                    monkeypatch):
    """A folder that exists but cannot be written in (read-only, or a file system like /proc) passed check_out and
    failed at the first write, after the model loaded and the first unit ran."""
    out = tmp_path / "read_only"
    out.mkdir()

    def refuse(*a, dir=None, **k):
        raise PermissionError(13, "Permission denied", dir)

    monkeypatch.setattr(tempfile, "TemporaryFile", refuse)
    err = _refused([command, "--out", str(out), "--no-progress"], capsys)
    assert f"--out {str(out)!r}: cannot write in the folder (Permission denied): expected a writable folder" in err


def test_a_writable_out_keeps_no_probe_file(stop_at_load, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("the user's")
    with pytest.raises(Loaded):
        main(["eval", "--out", str(out), "--no-progress", "--tasks", "passkey", "--lengths", "64"])
    assert os.listdir(out) == ["notes.txt"]  # the write check made its file and took it away


def test_a_plots_file_in_out_is_refused_before_the_run_unless_no_report_or_overwrite(stop_at_load, tmp_path,
                                                                                       capsys):
    """plots/ a file made write_report fail with a FileExistsError traceback after the whole run."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "plots").write_text("not a folder")
    argv = ["eval", "--out", str(out), "--no-progress", "--tasks", "passkey", "--lengths", "64"]
    err = _refused(argv, capsys)
    assert f"{out / 'plots'} is a file, where the report writes its plots/ folder" in err and "--no-report" in err
    with pytest.raises(Loaded):  # no report: plots/ is never written
        main(argv + ["--no-report"])
    assert (out / "plots").is_file()
    with pytest.raises(Loaded):  # --overwrite discards it with the rest of the old report
        main(argv + ["--overwrite"])
    assert not (out / "plots").exists()


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(passkey.FILLER_SENTENCES), trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


@pytest.fixture
def fake_model(tokenizer, monkeypatch):
    """A model with a config and a tokenizer but no weights: the checks after the load that need no forward."""
    cfg = ModelConfig(architecture="llama", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=512,
                      bos_token_id=0, eos_token_ids=(1,))
    model = types.SimpleNamespace(cfg=cfg, params=None, tokenizer=tokenizer, name="fake", mesh=None, stop_ids=())
    monkeypatch.setattr(jsparse, "load", lambda *a, **k: model)

    def no_work(*a, **k):
        raise AssertionError("methods were built although the run was refused")

    monkeypatch.setattr(harness, "build_methods", no_work)
    return model


def test_a_corpus_too_short_for_a_length_is_named_by_its_path(fake_model, tmp_path, capsys):
    corpus = tmp_path / "short_corpus.txt"
    corpus.write_text("The grass is green. " * 20)
    for tasks in (["--tasks", "ppl"], ["--tasks", "passkey", "--haystack", "corpus"]):
        err = _refused(["eval", "--out", str(tmp_path / "run"), "--no-progress", "--corpus", str(corpus),
                        "--lengths", "64,400", *tasks], capsys)
        assert f"--corpus {str(corpus)!r} at length 400: the corpus has" in err and "fewer than the" in err


def test_too_many_ppl_windows_name_the_flag_that_asked_for_them(fake_model, tmp_path, capsys):
    corpus = tmp_path / "small_corpus.txt"
    corpus.write_text(" ".join(passkey.FILLER_SENTENCES[:4]) * 4)
    base = ["eval", "--out", str(tmp_path / "run"), "--no-progress", "--corpus", str(corpus), "--tasks", "ppl",
            "--lengths", "64"]
    err = _refused(base + ["--samples", "2", "--ppl-samples", "5000"], capsys)
    assert f"--corpus {str(corpus)!r} at length 64: --ppl-samples 5000: the corpus" in err
    assert "use --ppl-samples <=" in err
    err = _refused(base + ["--samples", "5000"], capsys)
    assert "--samples 5000: the corpus" in err and "use --samples <=" in err


def test_a_token_budget_past_the_context_is_named_by_its_flag(fake_model, tmp_path, capsys):
    """It failed naming the builder option it became (`oracle option min_tokens=100000`), not the flag given."""
    err = _refused(["eval", "--out", str(tmp_path / "run"), "--no-progress", "--methods", "dense,oracle",
                    "--tasks", "passkey", "--lengths", "64", "--budget-tokens", "16,100000"], capsys)
    assert "--budget-tokens 100000: more than the model's context of 512 tokens; expected at most that" in err


BUTLER = "jsparse/shipped/smollm2/butler"


@pytest.mark.parametrize("extra, message", [
    (["--lengths", "2048,abc"], "length 'abc': expected a positive integer number of tokens"),
    (["--lengths", "2048,2048"], "name a length twice"),
    (["--sparsities", "0.3,x"], "--sparsities '0.3,x': 'x' is not a number; expected comma-separated fractions"),
    (["--sparsities", "0.3,0.3"], "--sparsities '0.3,0.3' names a sparsity twice"),
    (["--sparsities", "nan"], r"sparsity nan: expected a fraction in [0, 1)"),
    (["--tasks", " , "], "--tasks: expected a comma-separated list with at least one item"),
    (["--tasks", "ppl,ppl"], "--tasks 'ppl,ppl' names a task twice"),
    (["--methods", "quest,nosuch"], "unknown method 'nosuch'; valid methods:"),
    (["--methods", "quest,butler"], "--methods 'quest,butler' names 'butler', which runs anyway"),
    (["--samples", "0"], "--samples 0: expected an integer >= 1"),
    (["--acc-samples", "-1"], "--acc-samples -1: expected an integer >= 1"),
    (["--coref-length", "8"], "--coref-length 8: expected an integer >= 16"),
    (["--coref-sparsity", "1"], "--coref-sparsity 1.0: expected a fraction in [0, 1)"),
    (["--seed", "-1"], "--seed -1: expected an integer >= 0"),
    (["--corpus", "/nonexistent/book.txt"], "corpus '/nonexistent/book.txt' does not exist"),
    (["--artifact", "/nonexistent/butler"], "no artifact at '/nonexistent/butler'"),
    (["--artifact", "jsparse/shipped/smollm2/kascade"], "is a 'kascade' artifact: expected a 'butler' one"),
])
def test_butler_eval_checks_every_argument_before_the_model_loads(extra, message, no_load, tmp_path):
    argv = ["--artifact", BUTLER, "--out", str(tmp_path / "o"), *extra]
    with pytest.raises(SystemExit) as e:
        butler_eval.main(argv)
    assert message in str(e.value.code)
    assert not os.path.exists(tmp_path / "o")


def test_butler_eval_refuses_an_out_that_is_a_file_and_reaches_the_load_otherwise(stop_at_load, tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit, match="is an existing file: expected a folder"):
        butler_eval.main(["--artifact", BUTLER, "--out", str(tmp_path / "file")])
    with pytest.raises(Loaded):
        butler_eval.main(["--artifact", BUTLER, "--out", str(tmp_path / "o"), "--sparsities", "0,0.5",
                          "--lengths", "256,512"])
    assert (tmp_path / "o").is_dir()


def test_butler_eval_reads_its_arguments_into_the_run():
    args = types.SimpleNamespace(tasks="ppl, coref", methods="quest", sparsities="0.1,0.5", lengths="256,512",
                                 samples=1, acc_samples=1, coref_samples=1, chunk=64, acc_length=64,
                                 coref_length=64, seed=0, coref_sparsity=0.5, corpus=ppl.DEFAULT_CORPUS,
                                 artifact=BUTLER)
    assert butler_eval.check_args(args) == (["ppl", "coref"], ["quest"], [0.1, 0.5], (256, 512))
