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
    named = [p for p in re.findall(r"`((?:h100|cpu|kascade_diagnosis|sts_smollm2_2k|demo)/[^`]*)`", text)]
    assert len(named) > 20
    for rel in named:
        assert glob.glob(os.path.join(RESULTS, rel)), f"eval/results/README.md names {rel!r}, which does not exist"
    # Every headline JSON file the top-level README names is in the index.
    with open(os.path.join(RESULTS, "..", "..", "README.md")) as f:
        readme = f.read()
    for name in set(re.findall(r"`([\w.\-]+\.json)`", readme)) - {"results.json", "run.json", "artifact.json"}:
        assert name in text or not glob.glob(os.path.join(RESULTS, "**", name), recursive=True), name
