"""`jsparse bench model_table`: the README's end-to-end table from `jsparse bench model --methods` JSONs."""

import json
import os

import pytest

from eval.bench import model_table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _row(method, context, batch, ms, dense_ms, floor_speedup, **extra):
    r = dict(phase="decode", method=method, context=context, batch=batch, step_ms=ms, tokens_per_s=batch / ms * 1e3,
             floor_speedup=floor_speedup, speedup=dense_ms / ms)
    r["floor_fraction"] = r["speedup"] / floor_speedup
    r.update(extra)
    return r


def _run(tmp_path, name, rows, device="NVIDIA H100 80GB HBM3", checks=None, **extra):
    payload = dict(device=device, commit="abc1234", date="2026-12-02T10:00:00+00:00", benchmark="model_methods",
                   shape="llama3-8b", methods=checks or {}, rows=rows, **extra)
    path = tmp_path / name
    path.write_text(json.dumps(payload))
    return str(path)


def test_cells_link_their_json_with_speedup_floor_and_share(tmp_path):
    a = _run(tmp_path, "a.json", [_row("dense", 100000, 4, 16.0, 16.0, 1.0), _row("kascade", 100000, 4, 7.5, 16.0, 2.7),
                                  _row("streaming", 100000, 4, 5.6, 16.0, 3.33),
                                  dict(phase="prefill", method="dense", context=32768, batch=1, prefill_ms=900.0)],
             checks={"kascade": {"check": {"passed": False}}, "streaming": {"check": {"passed": True}}})
    b = _run(tmp_path, "b.json", [_row("dense", 100000, 4, 16.2, 16.2, 1.0), _row("dense", 32768, 1, 6.9, 6.9, 1.0),
                                  _row("butler", 100000, 4, 0.0 + 1, 16.2, 1.0,
                                       error="RESOURCE_EXHAUSTED: Out of memory while trying to allocate 47.35GiB "
                                             "with allocator GPU_0_bfc on device 0."),
                                  _row("evosparse", 32768, 1, 6.5, 6.9, 1.3, batch_asked="max")])
    text = model_table.markdown(model_table.load_runs([a, b]), link_root=str(tmp_path), bar=0.85)
    lines = text.splitlines()
    assert "NVIDIA H100 80GB HBM3" in lines[0] and "abc1234" in lines[0] and "2 run(s)" in lines[0]
    assert lines[2] == "| method | 32K, batch 1 (max) | 100K, batch 4 |"
    body = {ln.split(" | ")[0][2:]: ln for ln in lines[4:]}
    assert list(body) == ["dense", "dense (run 2)", "kascade", "streaming", "butler", "evosparse"]
    assert body["dense"] == "| dense | [145](b.json) | [250](a.json) |"  # each run's dense; b's 32K is its first
    assert body["dense (run 2)"] == "| dense (run 2) |  | [247](b.json) |"
    # 16 / 7.5 = 2.13x of a 2.70x floor: share 0.790, and its check failed in that run
    assert body["kascade"] == "| kascade |  | [533](a.json) (2.13x / 2.70x, 0.790) check failed |"
    assert body["streaming"] == "| streaming |  | [714](a.json) (2.86x / 3.33x, **0.858**) |"
    assert body["butler"] == "| butler |  | [out of memory (47.35GiB more)](b.json) |"
    assert body["evosparse"] == "| evosparse | [154](b.json) (1.06x / 1.30x, 0.817) |  |"  # under the bar: not bold


def test_bad_inputs_are_errors_naming_the_file_or_case(tmp_path):
    dense = _row("dense", 100000, 4, 16.0, 16.0, 1.0)
    a = _run(tmp_path, "a.json", [dense, _row("kascade", 100000, 4, 7.5, 16.0, 2.7)])
    b = _run(tmp_path, "b.json", [dense, _row("kascade", 100000, 4, 7.6, 16.0, 2.7)])
    with pytest.raises(ValueError, match=r"kascade at context 100000, batch 4 is in .*a.json and in .*b.json"):
        model_table.decode_cells(model_table.load_runs([a, b]))
    c = _run(tmp_path, "c.json", [dense], device="NVIDIA H200")
    with pytest.raises(ValueError, match=r"the runs differ in device: \['NVIDIA H100 80GB HBM3', 'NVIDIA H200'\]"):
        model_table.load_runs([a, c])
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"benchmark": "decode_step"}))
    with pytest.raises(ValueError, match="other.json: benchmark 'decode_step': expected 'model_methods'"):
        model_table.load_runs([str(other)])
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match="broken.json: not a readable JSON file"):
        model_table.load_runs([str(broken)])
    pre = _run(tmp_path, "prefill.json", [dict(_row("tsa", 131072, 1, 90.0, 100.0, 1.2), phase="prefill")])
    with pytest.raises(ValueError, match=r"no decode rows in .*prefill.json: the table is of decode rows"):
        model_table.decode_cells(model_table.load_runs([pre]))
    with pytest.raises(SystemExit):
        model_table.main([a, "--bar", "1.5"])
    assert [model_table.context_label(c) for c in (32768, 131072, 100000, 5000, 4097)] == [
        "32K", "128K", "100K", "5K", "4097"]


HISTORY = os.path.join("eval", "results", "e2e_history.md")


README_TABLES = [  # the tables made by the tool: (document, folder, JSONs); links relative to the document's folder
    ("README.md", ("h100", "e2e_1208"), ("e2e_a.json", "e2e_b.json", "e2e_c.json")),
    ("README.md", ("h100", "e2e_1208"), ("e2e_qwen3.json",)),
    (HISTORY, ("h200", "end_to_end"), ("bench_model_b1_1202.json", "bench_model_100k_b4_1202_a.json",
                                       "bench_model_100k_b4_1202_b.json")),
    (HISTORY, ("h200", "e2e_state"), ("e2e_a.json", "e2e_b.json")),
    (HISTORY, ("h200", "e2e_state"), ("e2e_qwen3.json",)),
]


@pytest.mark.parametrize("doc,folder,files", README_TABLES)
def test_the_readme_tables_are_the_tool_output_of_their_jsons(capsys, doc, folder, files):
    """The end-to-end tables of the README (H100 at Llama-3.1-8B and Qwen3-8B shapes) and of its history
    (eval/results/e2e_history.md: H200 of 2026-12-02 and 2026-12-03) are `jsparse bench model_table` of their JSONs,
    line for line, linked from the document's folder."""
    runs = [os.path.join("eval", "results", *folder, f) for f in files]
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        assert model_table.main([*runs, "--link-root", os.path.dirname(doc) or ".", "--bar", "0.85"]) == 0
    finally:
        os.chdir(cwd)
    table = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("|")]
    with open(os.path.join(ROOT, doc)) as f:
        text = f.read().splitlines()
    start = text.index(table[2]) - 2  # the first dense row (the header can repeat across tables)
    assert text[start:start + len(table)] == table


def test_a_share_at_the_bar_is_bold_and_a_bar_of_one_is_allowed(tmp_path, capsys):
    """The module docstring: "bold at or past `--bar`": a share exactly at the bar is bold, one just under it is not;
    --bar takes any share in (0, 1], 1.0 included."""
    a = _run(tmp_path, "a.json", [_row("dense", 32768, 1, 8.0, 8.0, 1.0), _row("streaming", 32768, 1, 4.0, 8.0, 2.5),
                                  _row("quest", 32768, 1, 4.0, 8.0, 2.0)])
    text = model_table.markdown(model_table.load_runs([a]), link_root=str(tmp_path), bar=0.8)
    body = {ln.split(" | ")[0][2:]: ln for ln in text.splitlines()[4:]}
    assert body["streaming"] == "| streaming | [250](a.json) (2.00x / 2.50x, **0.800**) |"  # 2 / 2.5 = 0.8: at the bar
    assert body["quest"] == "| quest | [250](a.json) (2.00x / 2.00x, **1.000**) |"
    assert model_table.main([a, "--bar", "1.0"]) == 0
    assert "(2.00x / 2.00x, **1.000**)" in capsys.readouterr().out


def test_runs_of_different_model_shapes_are_an_error(tmp_path):
    dense = _row("dense", 100000, 4, 16.0, 16.0, 1.0)
    a = _run(tmp_path, "a.json", [dense])
    b = tmp_path / "b.json"
    b.write_text(open(a).read().replace('"llama3-8b"', '"qwen3-8b"'))
    with pytest.raises(ValueError, match=r"the runs differ in shape: \['llama3-8b', 'qwen3-8b'\]"):
        model_table.load_runs([a, str(b)])


def test_no_json_is_an_error():
    with pytest.raises(ValueError,
                       match="no JSON given: expected one or more `jsparse bench model --methods ...` JSONs"):
        model_table.load_runs([])
