"""The `jsparse` command end to end on the bundled model."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse
from jsparse.cli import main


def test_generate_bundled_chat_says_paris(capsys):
    rc = main(["generate", "--model", "smollm2", "--chat", "--prompt", "What is the capital of France?",
               "--max-new-tokens", "8"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "Paris" in out


def test_generate_rejects_bad_budget(capsys):
    rc = main(["generate", "--model", "smollm2", "--prompt", "Hello", "--method", "oracle", "--budget", "1.5"])
    assert rc == 2
    assert "--budget 1.5: expected a fraction of the context in (0, 1] (a number of keys goes to --budget-tokens" \
        in capsys.readouterr().err


def test_generate_budget_only_for_methods_with_one_and_method_options_apply(capsys):
    """--budget for dense or tsa was silently ignored; --method-option reaches the builder: the shipped butler
    predictor's calibrated dense layers need a budget above 0.107 with rebalance, and butler.rebalance=false lifts
    that (the error names the command-line form)."""
    base = ["generate", "--model", "smollm2", "--prompt", "Hello", "--max-new-tokens", "2"]
    assert main(base + ["--method", "dense", "--budget", "0.5"]) == 2
    assert "--budget 0.5: method 'dense' takes no budget" in capsys.readouterr().err
    assert main(base + ["--method", "tsa", "--budget", "0.2"]) == 2
    assert "tsa.tau=T or tsa.kept_fraction=F" in capsys.readouterr().err
    butler = base + ["--method", "butler", "--artifact", "jsparse/shipped/smollm2/butler"]
    assert main(butler) == 2
    assert "--method-option butler.dense_set=[] or butler.rebalance=false" in capsys.readouterr().err
    assert main(butler + ["--method-option", "butler.rebalance=false"]) == 0
    capsys.readouterr()
    assert main(butler + ["--method-option", "butler.dense_set=[7,17],butler.budget_tokens=5"]) == 2  # a list value
    assert "the budget is set by --budget-tokens" in capsys.readouterr().err
    assert main(base + ["--method-option", "dense.foo=1"]) == 2
    assert "--method-option dense.foo=1: method 'dense' has no option 'foo'" in capsys.readouterr().err
    assert main(base + ["--method-option", "tsa.tau=0.01"]) == 2
    assert "names method 'tsa', which is not in --method dense" in capsys.readouterr().err


def test_calibrate_refuses_a_file_as_out_and_a_length_past_the_context(tmp_path, capsys):
    """Before the work: an --out that is a file (it failed with a traceback after the whole calibration), and a
    --length longer than the model's context (every calibrator ran on it)."""
    afile = tmp_path / "afile"
    afile.write_text("")
    assert main(["calibrate", "tsa", "--model", "smollm2", "--out", str(afile)]) == 2
    assert "is an existing file: expected a folder" in capsys.readouterr().err
    assert main(["calibrate", "tsa", "--model", "smollm2", "--length", "9000", "--out", str(tmp_path / "o")]) == 2
    assert "--length 9000: expected at most the model's context of 8192 tokens" in capsys.readouterr().err
    # --anchors replaced an explicit --target-share without a word.
    assert main(["calibrate", "kascade", "--model", "smollm2", "--anchors", "3", "--target-share", "0.9",
                 "--length", "256", "--samples", "1", "--out", str(tmp_path / "k")]) == 2
    assert "--anchors 3 and --target-share 0.9: the anchors come from one of the two rules" in capsys.readouterr().err
    # Refused before the model loads, by flag, leaving no empty --out folder: a budget of 1 (it searched for a
    # prompt length up to 2**30 first), an infinite reuse scale (written into the artifact as Infinity), a negative
    # seed, a corpus that is not UTF-8 (named).
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    out = tmp_path / "new"
    for extra, message in ((["--budget", "1.0"], "--budget 1.0: expected a fraction in (0, 1)"),
                           (["--reuse-scale", "inf"], "--reuse-scale inf: expected a finite number >= 1"),
                           (["--seed", "-1"], "--seed -1: expected an integer >= 0"),
                           (["--corpus", str(latin)], f"corpus '{latin}' is not UTF-8 text"),
                           # a repeated --corpus adds files (the earlier ones were dropped, with this one unread)
                           (["--corpus", str(latin), "--corpus", str(afile)], f"corpus '{latin}' is not UTF-8 text")):
        assert main(["calibrate", "kascade", "--model", "smollm2", "--out", str(out), *extra]) == 2, extra
        assert message in capsys.readouterr().err, extra
        assert not out.exists(), extra
    # An --out holding another method's artifact (a trained predictor, say) was replaced without a word.
    butler = tmp_path / "butler"
    butler.mkdir()
    (butler / "artifact.json").write_text('{"kind": "butler"}', encoding="utf-8")
    for method in ("tsa", "kascade"):
        assert main(["calibrate", method, "--model", "/nonexistent/model.gguf", "--out", str(butler)]) == 2
        assert (f"holds a 'butler' artifact, which calibrate {method} would replace with its '{method}' artifact"
                in capsys.readouterr().err)
    assert sorted(p.name for p in butler.iterdir()) == ["artifact.json"]


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["eval", "--help"], ["calibrate", "--help"],
                                  ["calibrate", "kascade", "--help"], ["calibrate", "sts", "--help"], ["train-predictor", "--help"],
                                  ["bench", "--help"], ["bench", "attention", "--help"], ["bench", "model", "--help"],
                                  ["bench", "decode_step", "--help"], ["bench", "evosparse", "--help"], ["bench", "tsa", "--help"]])
def test_every_command_has_help(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "usage: jsparse" in out
    assert not joined_examples(out), joined_examples(out)


def joined_examples(help_text: str) -> list[str]:
    """The example command lines of a help text that a docstring's bare line continuation (a backslash before the
    newline, not escaped) joined with their next line: `... h2o,butler         --context ...`."""
    return [ln for ln in help_text.splitlines() if re.match(r"\s+(jsparse|python3? -m) .*\S {4,}--", ln)]


def test_generate_speculative_with_layer_skipped_draft_equals_dense(capsys):
    argv = ["generate", "--model", "smollm2", "--chat", "--prompt", "What is the capital of France?",
            "--max-new-tokens", "8"]
    assert main(argv) == 0
    dense = capsys.readouterr().out
    assert main(argv + ["--draft", "smollm2:layers=0-9", "--gamma", "3"]) == 0
    captured = capsys.readouterr()
    assert captured.out == dense and "Paris" in dense
    assert "acceptance rate" in captured.err
    assert main(argv + ["--draft", "smollm2:layers=0-9", "--gamma", "0"]) == 2
    assert "gamma=0" in capsys.readouterr().err
    # On a mesh (of the one CPU device here; tests/sts_sharding_check.py runs 2x4 and 1x8): the draft is loaded
    # on the target's mesh and the same tokens come out.
    assert main(argv + ["--draft", "smollm2:layers=0-9", "--gamma", "3", "--mesh", "model=1"]) == 0
    assert capsys.readouterr().out == dense


def test_generate_budget_tokens_gives_each_method_its_fixed_budget(monkeypatch, capsys):
    """`generate --budget-tokens N`: EvoSparse's budget_tokens, a fraction method's min_tokens = N under a fraction
    small enough that k = min(N, visible keys) everywhere; refused beside --budget and for a method without one."""
    import jsparse
    from jsparse import selection as sel

    built = {}
    monkeypatch.setattr(jsparse, "generate", lambda model, prompts, method, **kw: built.update(m=method) or [""])
    base = ["generate", "--model", "smollm2", "--prompt", "hi", "--budget-tokens", "200"]
    assert main(base + ["--method", "evosparse", "--artifact", "jsparse/shipped/smollm2/evosparse"]) == 0
    assert built["m"].budget_tokens == 200
    assert main(base + ["--method", "quest"]) == 0
    m = built["m"]
    assert m.min_tokens == 200
    n = jnp.arange(1, 8193)
    assert np.array_equal(np.asarray(sel.budget_tokens(m.budget, n, m.min_tokens)), np.minimum(200, np.asarray(n)))
    monkeypatch.setattr(jsparse, "load", lambda *a, **k: pytest.fail("loaded the model before refusing"))
    for name in ("dense", "tsa"):  # refused before the model loads
        assert main(base + ["--method", name]) == 2
        assert f"--budget-tokens 200: method '{name}' takes no token budget" in capsys.readouterr().err
    # Builder-only variants (a class whose build makes a Butler) were refused as if they took no budget.
    monkeypatch.undo()
    monkeypatch.setattr(jsparse, "generate", lambda model, prompts, method, **kw: built.update(m=method) or [""])
    variant = ["--method", "butler-local", "--artifact", "jsparse/shipped/smollm2/butler",
               "--method-option", "butler-local.rebalance=false"]
    assert main(base + variant) == 0, capsys.readouterr().err
    assert type(built["m"]).__name__ == "Butler" and built["m"].min_tokens == 200 and built["m"].local == 32
    assert main(base[:-2] + ["--budget", "0.25"] + variant) == 0, capsys.readouterr().err
    assert built["m"].budget == 0.25
    # A seed at temperature 0 is said to do nothing (it did nothing silently).
    capsys.readouterr()
    assert main(base + ["--method", "quest", "--seed", "3"]) == 0
    assert "--seed 3 has no effect at temperature 0" in capsys.readouterr().err
    assert main(base + ["--method", "quest", "--budget", "0.5"]) == 2
    assert "expected one of them" in capsys.readouterr().err
    assert main(base[:-1] + ["0", "--method", "quest"]) == 2
    assert "budget tokens 0: expected a positive integer" in capsys.readouterr().err
    # STS reads a budget of 1 as the fraction 1 (every key): refused, as `jsparse eval` refuses it.
    assert main(base[:-1] + ["1", "--method", "sts", "--draft", "smollm2", "--artifact", "jsparse/shipped/smollm2/sts"]) == 2
    assert "--budget-tokens 1 with method 'sts'" in capsys.readouterr().err
    # The request's own values are checked before any model loads.
    plain = ["generate", "--model", "smollm2", "--prompt", "hi"]
    for extra, message in ((["--temperature", "-1"], "temperature=-1.0"), (["--top-p", "0"], "top_p=0.0"),
                           (["--max-new-tokens", "0"], "--max-new-tokens=0: expected an integer >= 1"),
                           (["--seed", str(2 ** 70)], "seed=1180591620717411303424"),
                           (["--gamma", "3"], "--gamma needs --draft"),
                           (["--gamma", "0", "--draft", "smollm2"], "gamma=0")):
        assert main(plain + extra) == 2, extra
        assert message in capsys.readouterr().err, extra


def test_generate_budget_tokens_builds_butler_once_at_its_token_budget(monkeypatch, capsys):
    """The shipped TokenButler artifact's calibrated dense layers need a budget above 3/28, so its default 0.1 does
    not build; `--budget-tokens N` builds it once, at the token budget (a first build at the default failed)."""
    import jsparse

    built, calls = {}, []
    real = jsparse.build_method
    monkeypatch.setattr(jsparse, "build_method", lambda name, model, **kw: calls.append(kw) or real(name, model, **kw))
    monkeypatch.setattr(jsparse, "generate", lambda model, prompts, method, **kw: built.update(m=method) or [""])
    base = ["generate", "--model", "smollm2", "--prompt", "hi", "--method", "butler", "--artifact",
            "jsparse/shipped/smollm2/butler"]
    assert main(base + ["--budget-tokens", "4096"]) == 0
    assert len(calls) == 1 and calls[0]["min_tokens"] == 4096 and built["m"].min_tokens == 4096
    assert main(base) == 2  # its default budget: the error names the range, the options that lower it, --budget
    err = capsys.readouterr().err
    assert "supported budgets: (0.1071, 1]" in err and "No --budget was given" in err and "pass --budget B" in err
    assert main(base + ["--artifact", "jsparse/shipped/smollm2/kascade"]) == 2  # one method, one artifact
    assert "--artifact given 2 times" in capsys.readouterr().err
    plain = ["generate", "--model", "smollm2", "--prompt", "hi", "--method", "streaming"]
    assert main(plain + ["--budget-tokens", "1"]) == 2  # an option the token budget set, named with it
    assert "--budget-tokens 1 (method options {'budget': " in capsys.readouterr().err


def test_generate_takes_tsa_kascade_artifacts_as_two_flags_and_hints_at_chat(monkeypatch, capsys):
    """`--artifact K --artifact T` gives tsa+kascade both artifacts (the last one alone was kept, and the error then
    asked for the Kascade one); an empty reply without --chat from a model with a chat template says why."""
    import jsparse

    seen = {}
    monkeypatch.setattr(jsparse, "generate", lambda model, prompts, method, **kw: seen.update(m=method) or [""])
    base = ["generate", "--model", "smollm2", "--prompt", "hi"]
    assert main(base + ["--method", "tsa+kascade", "--artifact", "jsparse/shipped/smollm2/kascade", "--artifact",
                        "jsparse/shipped/smollm2/tsa"]) == 0
    both = seen["m"]
    assert main(base + ["--method", "tsa+kascade", "--artifact",
                        "jsparse/shipped/smollm2/kascade:jsparse/shipped/smollm2/tsa"]) == 0
    joined = seen["m"]
    assert main(base + ["--method", "tsa+kascade", "--artifact", "jsparse/shipped/smollm2/kascade"]) == 0
    kascade_only = seen["m"]  # TSA uncalibrated: every layer but 0 sparse

    def same(a, b):
        la, ta = jax.tree.flatten(a)
        lb, tb = jax.tree.flatten(b)
        return ta == tb and all(np.array_equal(x, y) for x, y in zip(la, lb))

    assert same(both, joined) and not same(both, kascade_only)
    assert "expects --chat" in capsys.readouterr().err
    assert main(base + ["--chat"]) == 0
    assert "expects --chat" not in capsys.readouterr().err


def test_bench_help_lists_every_benchmark_module(capsys):
    """`jsparse bench --help` names every benchmark module of eval/bench (one with a `main`; not the shared helpers,
    common.py and evo_layout.py)."""
    import pathlib

    import eval.bench

    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    names = sorted(p.stem for p in pathlib.Path(eval.bench.__file__).parent.glob("*.py")
                   if p.stem != "__init__" and re.search(r"^def main\(", p.read_text(), re.M))
    assert len(names) >= 5 and "model" in names and "attention" in names
    for name in names:
        assert re.search(rf"^    {name}\b", out, re.M), name


def test_bench_record_schema_is_enforced(tmp_path):
    """Every benchmark JSON names device, jax, date, commit and command; a record without them is refused."""
    import json

    from eval.bench import common

    common.COMMAND = "jsparse bench model --steps 1"
    try:
        facts = common.device_facts()
        assert facts["command"] == "jsparse bench model --steps 1"
        common.write_json(str(tmp_path / "ok.json"), {**facts, "rows": []})
        assert json.loads((tmp_path / "ok.json").read_text())["command"] == "jsparse bench model --steps 1"
        with pytest.raises(ValueError, match="lacks \\['date', 'commit', 'command'\\]"):
            common.write_json(str(tmp_path / "bad.json"), {"device": "cpu", "jax": "0"})
        assert not (tmp_path / "bad.json").exists()
    finally:
        common.COMMAND = None


def test_every_benchmark_takes_its_output_as_out(capsys, tmp_path):
    """Every `jsparse bench NAME` takes `--out` (eval.bench.common.add_out_argument): the JSON file to write, or a
    folder (existing, or ending in '/') to write the benchmark's default file name in."""
    from eval.bench.common import out_path
    from jsparse.cli import BENCHMARKS

    not_a_json = {"anchor_mgpu": "output directory", "model_table": "markdown file"}  # several files; Markdown
    for name in sorted(BENCHMARKS) + ["attention"]:
        with pytest.raises(SystemExit) as exit_:
            main(["bench", name, "--help"])
        assert exit_.value.code == 0, name
        out = capsys.readouterr().out
        assert not joined_examples(out), (name, joined_examples(out))
        text = " ".join(out.split())
        assert "--out" in text, f"jsparse bench {name} takes no --out"
        assert (not_a_json.get(name) or "JSON file to write, or a folder to write") in text, (name, text)
    assert out_path(None, "x.json") is None  # an optional --out not given
    assert out_path(str(tmp_path), "x.json") == str(tmp_path / "x.json")
    assert out_path(str(tmp_path / "new") + "/", "x.json") == str(tmp_path / "new" / "x.json")
    assert (tmp_path / "new").is_dir()
    assert out_path(str(tmp_path / "f.json"), "x.json") == str(tmp_path / "f.json")


def test_bench_attention_writes_its_json_through_the_cli(tmp_path, capsys):
    """`jsparse bench attention --out DIR/` writes its JSON (bench_attention.json) in that new folder, with args
    that are the command's options (the CLI's own handler, a function, once made the write fail after the whole
    run)."""
    import json

    main(["bench", "attention", "--phase", "decode", "--context", "256", "--batch", "1", "--interpret", "--no-check",
          "--no-variants", "--time-budget", "1", "--out", str(tmp_path / "new") + "/"])
    data = json.loads((tmp_path / "new" / "bench_attention.json").read_text())
    assert data["args"]["context"] == "256" and data["args"]["phase"] == "decode"
    assert data["records"] and data["command"].startswith("jsparse bench attention")


def test_generate_flags_reach_generate(monkeypatch, capsys):
    """`jsparse generate`'s --temperature/--top-p/--seed/--chat/--dtype reach jsparse.load / jsparse.generate unchanged
    (mutation: `seed=args.seed` -> `seed=0` in jsparse/cli.py survived the suite)."""
    loads, calls = [], []
    real_load = jsparse.load

    def load(spec, dtype=None, **kw):
        loads.append(dtype)
        return real_load(spec, dtype, **kw)

    def generate(model, prompts, **kw):
        calls.append(kw)
        return ["stub"]

    monkeypatch.setattr(jsparse, "load", load)
    monkeypatch.setattr(jsparse, "generate", generate)
    rc = main(["generate", "--model", "smollm2", "--prompt", "Hi", "--max-new-tokens", "3", "--temperature", "0.7",
               "--top-p", "0.9", "--seed", "123", "--chat", "--dtype", "float32"])
    assert rc == 0 and "stub" in capsys.readouterr().out
    assert loads and str(loads[0]) == "float32"
    (kw,) = calls
    assert kw["temperature"] == 0.7 and kw["top_p"] == 0.9 and kw["seed"] == 123
    assert kw["chat"] is True and kw["max_new_tokens"] == 3


def test_calibrate_refuses_too_short_prompts_or_no_samples_and_a_length_one_past_the_context(tmp_path, capsys):
    """--length 1 (no next token to predict) and --samples 0 are refused by flag before the model loads; --length
    8193 is one past smollm2's 8192-token context; an unknown flag is a usage error, not silently dropped."""
    out = tmp_path / "o"
    for extra, message in ((["--length", "1"], "--length 1: expected an integer >= 2"),
                           (["--samples", "0"], "--samples 0: expected an integer >= 1")):
        assert main(["calibrate", "tsa", "--model", "/nonexistent/model.gguf", "--out", str(out), *extra]) == 2
        assert message in capsys.readouterr().err
        assert not out.exists()
    assert main(["calibrate", "tsa", "--model", "smollm2", "--length", "8193", "--out", str(out)]) == 2
    assert "--length 8193: expected at most the model's context of 8192 tokens" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["generate", "--prompt", "Hi", "--bogus-flag"])
    assert e.value.code == 2 and "unrecognized arguments: --bogus-flag" in capsys.readouterr().err


def test_bench_forwards_its_arguments_prog_and_exit_status(monkeypatch, capsys):
    """`jsparse bench NAME ARGS...` hands every ARG (in order, values and positionals too) to NAME's module
    `main(argv, prog="jsparse bench NAME")`, sets the command its JSON records before the module runs, and returns
    the module's exit status (None: 0). A real module's usage error names `jsparse bench NAME` and the argument
    that was passed last (model_table checks --bar before reading any file; nothing runs)."""
    import sys
    import types

    from eval.bench import common
    from jsparse.cli import BENCHMARKS

    with pytest.raises(SystemExit) as e:
        main(["bench", "model_table", "runs.json", "--link-root", ".", "--bar", "2"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "usage: jsparse bench model_table " in err
    assert "--bar 2.0: expected a share in (0, 1]" in err

    calls = []

    def fake_main(argv, prog=None):
        calls.append((list(argv), prog, common.COMMAND))
        return len(calls) - 1  # 0, then 1

    fake = types.ModuleType("fake_bench_module")
    fake.main = fake_main
    monkeypatch.setitem(sys.modules, "fake_bench_module", fake)
    monkeypatch.setitem(BENCHMARKS, "fake", ("fake_bench_module", "a stand-in benchmark"))
    monkeypatch.setattr(common, "COMMAND", None)
    argv = ["--context", "4096", "in.json", "--flag", "--out", "x/"]
    assert main(["bench", "fake", *argv]) == 0
    assert main(["bench", "fake", "--help"]) == 1
    assert calls == [(argv, "jsparse bench fake", "jsparse bench fake --context 4096 in.json --flag --out x/"),
                     (["--help"], "jsparse bench fake", "jsparse bench fake --help")]
    fake.main = lambda argv, prog=None: None
    assert main(["bench", "fake"]) == 0


@pytest.mark.parametrize("option, flag", [("sts.draft=bogus", "--draft"), ("sts.artifact=/nonexistent", "--artifact")])
def test_generate_refuses_a_method_option_its_flag_would_replace(capsys, option, flag):
    """`--method-option sts.draft=...` / `sts.artifact=...` were replaced by --draft / --artifact without a word;
    refused before the model loads, naming the flag."""
    assert main(["generate", "--model", "/nonexistent/model.gguf", "--prompt", "Hi", "--method", "sts",
                 "--method-option", option]) == 2
    key, value = option.split(".", 1)[1].split("=")
    assert f"--method-option sts.{key}={value!r}: the {key} is given by {flag}" in capsys.readouterr().err


def test_generate_refuses_a_token_budget_past_the_context(capsys):
    """--budget-tokens above the model's context (no row ever sees that many keys) was turned into every key."""
    assert main(["generate", "--model", "smollm2", "--prompt", "Hi", "--method", "oracle",
                 "--budget-tokens", "100000"]) == 2
    assert ("--budget-tokens 100000: more than the model's context of 8192 tokens; expected at most that"
            in capsys.readouterr().err)
