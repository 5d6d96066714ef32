"""`jsparse bench op_census`: a method's decode step traced as a GPU traces it (no device, shapes only), one census
row per layer scan."""

import json

import jax
import pytest

from eval.bench import op_census


def _census(method, gpu=True, shape="llama3-8b", options=None):
    """(every op-census row of one decode step at 100K, batch 4, the model's config)."""
    jaxpr, cfg = op_census.trace_step(method, shape, batch=4, context=100000, budget=0.1, gpu=gpu, options=options)
    return op_census.census(jaxpr.jaxpr), cfg


def _scan_rows(census, cfg):
    rows = [r for r in census if r["path"] == "scan/"]  # the layer scans of the step loop
    assert sum(r["length"] for r in rows) == cfg.num_layers
    return rows


def _layer_rows(method, gpu=True, shape="llama3-8b"):
    return _scan_rows(*_census(method, gpu, shape))


def test_dense_layers_run_their_gpu_kernels_only_on_the_gpu_paths():
    """On the GPU paths every dense layer calls `rope_write` and the in-place dense decode; on a CPU host's own paths
    none calls a Pallas kernel (a GPU host's own paths are the GPU's). The backend is restored after the trace."""
    host = jax.default_backend()
    rows = _layer_rows("dense")
    assert [r["kernels"] for r in rows] == [["rope_write", "dense_decode_stacked"]]
    assert jax.default_backend() == host
    own = [r["kernels"] for r in _layer_rows("dense", gpu=False)]
    if host == "cpu":
        assert all(not k for k in own), own
    elif host == "gpu":
        assert own == [r["kernels"] for r in rows]


def test_evosparse_layers_derive_no_budget_of_their_own():
    """EvoSparse's sparse layers read the step's plan (`start_rows`): no layer body computes the block budget's floor
    divisions (`rem`, `sign`: five small kernels a layer when each layer derived it). The layers that score their
    retrieval heads run the block max and its top-k, and select themselves and the layers that inherit their set at
    once (`group_select`); the others run no scoring and no selection. Each sparse layer's gathered decode also
    finishes itself (`finish_in_launch`: no second launch) and answers in the GEMMs' padded rows (no pad op)."""
    rows = _layer_rows("evosparse")
    sparse = [r for r in rows if "sparse_decode_gathered_stacked_mass_finish" in r["kernels"]]
    assert len(sparse) >= 2 and sum(r["length"] for r in sparse) == 30  # two dense layers first
    for r in sparse:
        assert "rem" not in r["ops"] and "sign" not in r["ops"], r["ops"]
        assert "evosparse_finish_heat" not in r["kernels"] and "pad" not in r["ops"], (r["kernels"], r["ops"])
    assert all("pad" in r["ops"] for r in rows if r not in sparse)  # the dense layers' output is padded by the model
    scoring = [r for r in sparse if "evosparse_block_max" in r["kernels"]]
    assert scoring and len(scoring) < len(sparse)
    for r in sparse:
        assert ("evosparse_select_span" in r["kernels"]) == (r in scoring), r["kernels"]
        assert "evosparse_select_candidates" not in r["kernels"]
    assert min(r["eqns"] for r in scoring) > max(r["eqns"] for r in sparse if r not in scoring)


def test_main_writes_the_census(tmp_path, capsys):
    out = tmp_path / "census.json"
    assert op_census.main(["--method", "streaming", "--context", "4096", "--batch", "2", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["benchmark"] == "op_census" and payload["gpu_paths"] is True
    layers = [r for r in payload["scans"] if r["path"] == "scan/"]
    assert sum(r["length"] for r in layers) == payload["num_layers"] == 32
    printed = capsys.readouterr().out
    assert "| scan/ |" in printed and "XLA ops over at least 4 MiB" in printed
    assert payload["large_mb"] == 4.0 and isinstance(payload["large_ops"], list)


def test_large_ops_find_whole_array_passes_outside_the_kernels():
    """`large_ops` lists the XLA ops over large arrays outside the kernels and GEMMs. H2O's one top-k over every
    layer's scores [L, B, Hkv, N] reads its span in place at batch 1 (the "sample" path, 256 rows): no op of the step
    touches an array of that size (a masked copy of it was 63 us a step on an H100). The oracle's pooling of each
    layer's logits is an XLA pass at batch 4 (`AnchorConfig.pool="auto"` above one query row): found in its sparse
    layers' scan, 31 a step; at batch 1 the Triton pooling pass reads them (no such XLA op).
    Dense has none (the embedding's gather counts the rows it picks, not the table)."""
    jaxpr, cfg = op_census.trace_step("h2o", "llama3-8b", batch=1, context=100000, budget=0.1, gpu=True)
    scores = cfg.num_layers * cfg.num_kv_heads * 100096 * 4  # the score rows' bytes at this cache size
    assert op_census.large_ops(jaxpr.jaxpr, 4 << 20) and not op_census.large_ops(jaxpr.jaxpr, scores // 2)
    jaxpr, _ = op_census.trace_step("oracle", "llama3-8b", batch=4, context=100000, budget=0.1, gpu=True)
    pool = [r for r in op_census.large_ops(jaxpr.jaxpr, 4 << 20) if r["op"] == "exp"]
    assert pool and all(r["per_step"] == cfg.num_layers - 1 and r["shape"][-1] == 100096 for r in pool)
    jaxpr, _ = op_census.trace_step("oracle", "llama3-8b", batch=1, context=100000, budget=0.1, gpu=True)
    assert not [r for r in op_census.large_ops(jaxpr.jaxpr, 4 << 20) if r["op"] == "exp"]
    jaxpr, _ = op_census.trace_step("dense", "llama3-8b", batch=4, context=100000, budget=0.1, gpu=True)
    assert op_census.large_ops(jaxpr.jaxpr, 4 << 20) == []


def test_h2o_layers_run_one_launch_and_the_step_one_mass_launch():
    """H2O's gathered decode on the GPU paths with `mass_at_end`: each layer runs one launch, which merges its own
    output into the GEMMs' padded rows (no `evosparse_finish_heat`, no pad op); the step adds every layer's mass in
    one `pending_mass` launch after the layer scan. By default (mass_at_end=False) the two launches a layer."""
    census, cfg = _census("h2o", options={"mass_at_end": True})
    rows = _scan_rows(census, cfg)
    assert [r["kernels"] for r in rows] == [["rope_write", "sparse_decode_gathered_stacked_mass_finish"]]
    assert "pad" not in rows[0]["ops"]
    step = [r for r in census if "pending_mass" in r["kernels"]]
    assert len(step) == 1 and step[0]["path"] != "scan/" and step[0]["length"] == 1
    census, cfg = _census("h2o")
    rows = _scan_rows(census, cfg)
    assert [r["kernels"] for r in rows] == [["rope_write", "sparse_decode_gathered_stacked_mass",
                                             "evosparse_finish_heat"]]
    assert not any("pending_mass" in r["kernels"] for r in census)


@pytest.mark.parametrize("argv,message", [
    (["--method", "evosparse", "--budget", "0.2"], "method 'evosparse' is built without it"),
    (["--method", "dense", "--budget", "0.2"], "method 'dense' is built without it"),
    (["--method", "streaming", "--budget", "7"], "--budget 7: expected a kept fraction"),
])
def test_op_census_refuses_a_budget_it_would_not_use(argv, message, capsys):
    with pytest.raises(SystemExit):
        op_census.main(argv)
    assert message in capsys.readouterr().err
