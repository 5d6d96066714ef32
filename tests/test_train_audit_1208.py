"""`jsparse train-predictor` on bad input: every option refused by value and flag before the model loads (where it
needs no model), corpora too short named by path, an --out that cannot be written, and a checkpoint of another run
refused with what differs (the audit of 2026-12-08)."""

import errno
import os
import tempfile
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse
import train.loop as train_loop
from jsparse.cli import main
from models.config import ModelConfig
from models.params import random_params
from train import data as data_lib
from train.loop import TrainConfig, TrainError, check_resume_config, train
from train.predictor import preset_config

from tests.test_train import _stub_train

CFG = ModelConfig(architecture="llama", vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512)
T = 32
TC = TrainConfig(seq_len=T, steps=2, batch_size=2, warmup_steps=0, checkpoint_every=1, learning_rate=1e-2)
TEXT = "The quick brown fox jumps over the lazy dog. " * 20


class Tok:
    """Bytes folded into the tiny model's vocabulary; EOS 0, BOS 1."""

    eos_token_id = 0

    def __call__(self, texts, add_special_tokens=True, verbose=False):
        ids = [2 + b % 60 for b in texts.encode()]
        return {"input_ids": ([1] if add_special_tokens else []) + ids}


@pytest.fixture
def cli(tmp_path, monkeypatch):
    """Runs `jsparse train-predictor` with the tiny model (a stub load that records each load) and `train` stubbed;
    returns run(*argv) -> (rc, stderr, loads, seen)."""
    loads, seen = [], {}
    model = types.SimpleNamespace(cfg=CFG, params=None, tokenizer=Tok(), name="tiny")

    def load(name, dtype=None):
        loads.append(name)
        return model

    monkeypatch.setattr(jsparse, "load", load)
    monkeypatch.setattr(jsparse, "fingerprint", lambda m: "fp-tiny")
    _stub_train(monkeypatch, seen)
    text = tmp_path / "text.txt"
    text.write_text(TEXT, encoding="utf-8")

    def run(*argv):
        loads.clear()
        seen.clear()
        full = ["train-predictor", "--model", "tiny", "--no-progress", *argv]
        if "--data" not in argv:
            full += ["--data", str(text)]
        if "--out" not in argv:
            full += ["--out", str(tmp_path / "out")]
        return main(full), list(loads), dict(seen)

    return run


@pytest.mark.parametrize("extra, message", [
    (["--batch-size", "0"], "batch_size=0 (--batch-size): expected an integer >= 1"),
    (["--batch-size", "-2"], "batch_size=-2 (--batch-size): expected an integer >= 1"),
    (["--seq-len", "8"], "seq_len=8 (--seq-len): expected an integer >= 16"),
    (["--seq-len", "-5"], "seq_len=-5 (--seq-len): expected an integer >= 16"),
    (["--lr", "nan"], "learning_rate=nan (--lr): expected a number in (0, 1.0]"),
    (["--lr=-1"], "learning_rate=-1.0 (--lr): expected a number in (0, 1.0]"),
    (["--lr", "inf"], "learning_rate=inf (--lr): expected a number in (0, 1.0]"),
    (["--end-lr-ratio", "nan"], "end_lr_ratio=nan (--end-lr-ratio): expected a number in [0, 1.0]"),
    (["--weight-decay=-1e-13"], "weight_decay=-1e-13 (--weight-decay): expected a number in [0, 1.0]"),
    (["--clip-norm", "0"], "clip_norm=0.0 (--clip-norm): expected a positive finite number"),
    (["--warmup", "5"], "warmup_steps=5 (--warmup): expected fewer than steps=5"),
    (["--seed", "-1"], "seed=-1 (--seed): expected an integer >= 0"),
    (["--checkpoint-every", "0"], "checkpoint_every=0 (--checkpoint-every): expected an integer >= 1"),
    (["--checkpoint-every", "6"], "--checkpoint-every 6 is more than --steps 5: no checkpoint would be saved before "
                                  "the last step; expected at most 5"),
    (["--head-dim", "0"], "--head-dim 0: expected a positive integer"),
    (["--head-dim", "3"], "--head-dim 3: expected an even width"),
    (["--qk-hidden", "-3"], "--qk-hidden -3: expected a positive integer"),
    (["--preset", "bogus"], "unknown predictor preset 'bogus'; expected one of ['auto', 'llama3-8b'"),
    (["--max-seconds", "nan"], "--max-seconds nan: expected a positive number of seconds"),
])
def test_bad_options_are_refused_before_the_model_loads(cli, tmp_path, capsys, extra, message):
    """Each of these needs no model: refused naming the value and the flag, with no model loaded and no --out left
    (all but --max-seconds were checked after the load before, and --checkpoint-every above --steps was taken)."""
    rc, loads, _ = cli("--steps", "5", "--seq-len", str(T), *extra)
    assert rc == 2 and loads == []
    assert message in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("extra, message", [
    (["--steps", "1.5"], "argument --steps: invalid int value: '1.5'"),
    (["--steps", "nan"], "argument --steps: invalid int value: 'nan'"),
    (["--steps", "5", "--batch-size", "2.0"], "argument --batch-size: invalid int value: '2.0'"),
    (["--steps", "5", "--seq-len", "1e3"], "argument --seq-len: invalid int value: '1e3'"),
    (["--steps", "5", "--lr", "fast"], "argument --lr: invalid float value: 'fast'"),
    (["--steps", "5", "--bogus"], "unrecognized arguments: --bogus"),
])
def test_non_numbers_and_unknown_options_are_parser_errors(cli, capsys, extra, message):
    with pytest.raises(SystemExit) as e:
        cli(*extra)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_checkpoint_every_defaults_to_at_most_the_steps(cli):
    """The default interval is min(100, steps), so that the default is never refused as more than --steps."""
    assert cli("--steps", "5", "--seq-len", str(T))[2]["tc"].checkpoint_every == 5
    assert cli("--steps", "500", "--seq-len", str(T))[2]["tc"].checkpoint_every == 100
    assert cli("--steps", "5", "--seq-len", str(T), "--checkpoint-every", "5")[2]["tc"].checkpoint_every == 5


def test_seq_len_above_the_models_context_is_refused_after_the_load(cli, capsys):
    """The model's context is the one bound that needs the model: named with the flag once it is loaded."""
    rc, loads, _ = cli("--steps", "5", "--seq-len", "513")
    assert rc == 2 and loads == ["tiny"]
    assert "seq_len=513 (--seq-len): expected an integer in [16, 512] (the model's context)" in capsys.readouterr().err


def test_a_corpus_too_short_for_the_sequence_length_is_named(cli, tmp_path, capsys):
    """Too few tokens for one chunk: the error names the file (it said "the training data" before)."""
    short = tmp_path / "short.txt"
    short.write_text("short text", encoding="utf-8")
    assert cli("--steps", "5", "--seq-len", "64", "--data", str(short))[0] == 2
    assert (f"training data file {os.path.realpath(short)!r} has 10 tokens, fewer than the 63 one chunk of seq_len=64 "
            "needs: give more text or a shorter --seq-len") in capsys.readouterr().err
    other = tmp_path / "other.txt"
    other.write_text("more", encoding="utf-8")
    assert cli("--steps", "5", "--seq-len", "64", "--data", str(short), str(other))[0] == 2
    assert f"the training data (2 files: {os.path.realpath(other)!r}, {os.path.realpath(short)!r}) has" in \
        capsys.readouterr().err
    paths = [f"/d/{i}.txt" for i in range(5)]
    assert data_lib.describe_files(paths) == ("the training data (5 files: '/d/0.txt', '/d/1.txt', '/d/2.txt' and 2 "
                                              "more)")


def test_an_unreadable_data_file_is_named(tmp_path, monkeypatch):
    """An OSError reading a file (no permission) is a DataError naming it, not a traceback."""
    path = tmp_path / "locked.txt"
    path.write_text("text", encoding="utf-8")

    def denied(file, *a, **kw):
        raise PermissionError(errno.EACCES, "Permission denied", file)

    monkeypatch.setattr(data_lib, "open", denied, raising=False)
    with pytest.raises(data_lib.DataError, match=r"locked.txt' cannot be read \(Permission denied\): expected a "
                                                 "readable UTF-8 text file"):
        data_lib.read_text(str(path))


@pytest.mark.parametrize("where", ["", "checkpoints"])
def test_an_out_that_cannot_be_written_is_refused_before_the_model_loads(cli, tmp_path, monkeypatch, capsys, where):
    """An --out (or its checkpoints folder, of an earlier run) this user cannot write in passed the checks, and the
    run failed with a PermissionError traceback at its first checkpoint, after loading the model and tokenizing.
    (Simulated: the tests run as root, whom permissions do not stop.)"""
    out = tmp_path / "readonly"
    (out / where).mkdir(parents=True)
    denied = os.path.realpath(out / where)
    real = tempfile.TemporaryFile

    def temporary_file(*a, dir=None, **kw):
        if dir is not None and os.path.realpath(dir) == denied:
            raise PermissionError(errno.EACCES, "Permission denied")
        return real(*a, dir=dir, **kw)

    monkeypatch.setattr(tempfile, "TemporaryFile", temporary_file)
    rc, loads, _ = cli("--steps", "5", "--seq-len", str(T), "--out", str(out))
    assert rc == 2 and loads == []
    err = capsys.readouterr().err
    assert f"--out {str(out)!r}: cannot write in " in err and "(Permission denied)" in err
    if where:
        assert f"cannot write in {str(out / where)!r}" in err


def test_a_loss_log_that_cannot_be_appended_to_is_refused(cli, tmp_path, monkeypatch, capsys):
    """loss.jsonl of an earlier run, read-only: refused before the load (the first step failed on it)."""
    import builtins

    out = tmp_path / "out"
    out.mkdir()
    log = out / "loss.jsonl"
    log.write_text('{"step": 1, "loss": 2.0}\n')
    real = builtins.open

    def fake_open(file, mode="r", *a, **kw):
        if str(file) == str(log) and "a" in mode:
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return real(file, mode, *a, **kw)

    monkeypatch.setattr(builtins, "open", fake_open)
    rc, loads, _ = cli("--steps", "5", "--seq-len", str(T), "--out", str(out))
    monkeypatch.undo()
    assert rc == 2 and loads == []
    assert f"cannot append to {str(log)!r} (Permission denied)" in capsys.readouterr().err
    assert log.read_text() == '{"step": 1, "loss": 2.0}\n'


@pytest.fixture(scope="module")
def model_params():
    return jax.jit(random_params, static_argnums=(0, 2, 3))(CFG, jax.random.key(0), jnp.float32, 0.2)


@pytest.fixture(scope="module")
def chunks():
    return np.random.default_rng(0).integers(0, CFG.vocab_size, (5, T)).astype(np.int32)


@pytest.fixture(scope="module")
def finished(tmp_path_factory, model_params, chunks):
    out = str(tmp_path_factory.mktemp("run"))
    train(CFG, model_params, fingerprint="fp-a", chunks=chunks, out_dir=out, tc=TC, pcfg=preset_config(CFG, "auto"),
          progress=False)
    return out


def test_a_checkpoint_of_another_training_config_is_refused_before_the_model_loads(finished, cli, capsys):
    """The training config a checkpoint records needs no model to compare: another --lr is refused naming the field,
    before the load (it loaded the model and tokenized the data first)."""
    check_resume_config(finished, TC)  # the same config: nothing to say
    with pytest.raises(TrainError, match=r"used another training config: \(checkpoint, now\) = "
                                         r"\{'learning_rate': \(0.01, 0.02\)\}"):
        check_resume_config(finished, TrainConfig(**{**TC.__dict__, "learning_rate": 2e-2}))
    rc, loads, _ = cli("--steps", "2", "--seq-len", str(T), "--batch-size", "2", "--lr", "0.02", "--warmup", "0",
                       "--out", finished)
    assert rc == 2 and loads == []
    assert "used another training config: (checkpoint, now) = {'learning_rate': (0.01, 0.02)}" in \
        capsys.readouterr().err
    check_resume_config(os.path.dirname(finished), TC)  # no checkpoints: nothing to say


def test_a_checkpoint_of_other_data_names_the_chunk_counts(finished, model_params, chunks):
    """Other data is refused with both fingerprints and, when they differ, both chunk counts (a digest alone said
    little), and nothing of the run is changed."""
    before = sorted(os.listdir(os.path.join(finished, "checkpoints")))
    with pytest.raises(TrainError, match=r"was made with another data set: fingerprint '\w+' \(5 chunks\), now '\w+' "
                                         r"\(4 chunks\); use the same --data files"):
        train(CFG, model_params, fingerprint="fp-a", chunks=chunks[:4], out_dir=finished, tc=TC,
              pcfg=preset_config(CFG, "auto"), progress=False)
    with pytest.raises(TrainError, match=r"another data set: fingerprint '\w+', now '\w+'; use"):
        train(CFG, model_params, fingerprint="fp-a", chunks=chunks[::-1], out_dir=finished, tc=TC,
              pcfg=preset_config(CFG, "auto"), progress=False)
    assert sorted(os.listdir(os.path.join(finished, "checkpoints"))) == before


@pytest.mark.parametrize("bad", [CFG.vocab_size, -1])
def test_token_ids_outside_the_vocabulary_are_refused(tmp_path, model_params, chunks, bad):
    """A tokenizer of another model gave ids past the vocabulary: the run trained to a nan loss and blamed --lr."""
    wrong = chunks.copy()
    wrong[2, 5] = bad
    out = tmp_path / "out"
    with pytest.raises(TrainError, match=rf"the chunks hold token id {bad}: expected ids in \[0, 64\), the model's "
                                         "vocabulary"):
        train(CFG, model_params, fingerprint="fp-a", chunks=wrong, out_dir=str(out), tc=TC,
              pcfg=preset_config(CFG, "auto"), progress=False)
    assert not out.exists()


def test_model_free_validation_leaves_only_the_models_bounds():
    """validate(None, n): every check but seq_len's upper bounds; the bool and tiny-negative leaks are closed."""
    big = TrainConfig(**{**TC.__dict__, "seq_len": 100_000})
    assert big.validate(None, 1) is big
    with pytest.raises(TrainError, match=r"seq_len=100000: expected an integer in \[16, 512\]"):
        big.validate(CFG, 1)
    with pytest.raises(TrainError, match="not a multiple of the 2 devices"):
        TrainConfig(**{**TC.__dict__, "batch_size": 3}).validate(None, 2)
    for change, msg in (({"learning_rate": True}, r"learning_rate=True: expected a number in \(0, 1.0\]"),
                        ({"weight_decay": -1e-13}, r"weight_decay=-1e-13: expected a number in \[0, 1.0\]"),
                        ({"end_lr_ratio": -1e-13}, r"end_lr_ratio=-1e-13: expected a number in \[0, 1.0\]"),
                        ({"seq_len": 16.0}, r"seq_len=16.0: expected an integer >= 16")):
        with pytest.raises(TrainError, match=msg):
            TrainConfig(**{**TC.__dict__, **change}).validate(None, 1)
