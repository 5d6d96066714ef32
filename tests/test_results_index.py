"""eval/results stays indexed and reproducible: every benchmark JSON names its command, every indexed file exists."""

import glob
import json
import os
import re

RESULTS = os.path.join(os.path.dirname(__file__), "..", "eval", "results")
# Per-prompt outputs and calibration artifacts: data beside a run whose run.json / meta names the command.
NOT_RECORDS = {"passkey_outputs.json", "coref_outputs.json", "artifact.json"}


def _record_files():
    for path in sorted(glob.glob(os.path.join(RESULTS, "**", "*.json"), recursive=True)):
        if os.path.basename(path) not in NOT_RECORDS:
            yield path


def test_every_committed_benchmark_json_names_its_command():
    missing = []
    for path in _record_files():
        with open(path) as f:
            data = json.load(f)
        if isinstance(data, list):  # `jsparse eval` records: the command is in run.json beside them
            continue
        command = data.get("command") or (data.get("meta") or {}).get("command")
        if not (isinstance(command, str) and command.strip()):
            missing.append(os.path.relpath(path, RESULTS))
    assert not missing, f"benchmark JSON without a 'command' field: {missing}"


def test_results_index_names_existing_files():
    with open(os.path.join(RESULTS, "README.md")) as f:
        text = f.read()
    tops = sorted(d for d in os.listdir(RESULTS) if os.path.isdir(os.path.join(RESULTS, d)))
    named = re.findall(r"`((?:%s)/[^`]*)`" % "|".join(map(re.escape, tops)), text)
    assert len(named) > 100 and {p.split("/")[0] for p in named} >= {"h100", "h200", "cpu"}

    def expand(pattern: str) -> list[str]:  # `a_{x,y}.json` names a_x.json and a_y.json
        m = re.search(r"\{([^{}]*)\}", pattern)
        return [pattern] if m is None else [q for alt in m.group(1).split(",")
                                            for q in expand(pattern[:m.start()] + alt + pattern[m.end():])]

    for rel in named:
        for path in expand(rel):
            assert glob.glob(os.path.join(RESULTS, path)), \
                f"eval/results/README.md names {path!r}, which does not exist (a path split over two lines?)"
    # Every headline JSON file the top-level README names is in the index.
    with open(os.path.join(RESULTS, "..", "..", "README.md")) as f:
        readme = f.read()
    for name in set(re.findall(r"`([\w.\-]+\.json)`", readme)) - {"results.json", "run.json", "artifact.json"}:
        assert name in text or not glob.glob(os.path.join(RESULTS, "**", name), recursive=True), name
