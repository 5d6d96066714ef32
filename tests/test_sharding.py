"""Sharding on a CPU mesh of 8 virtual devices: every method's prefill and decode on 2x4 and 1x8 meshes equal the
one-device output (tests/sharding_check.py, run in a fresh process: the device count is fixed when jax starts,
and this suite's process has one CPU device), plus the mesh spec and head-divisibility errors (in-process)."""

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from models import sharding
from models.config import ModelConfig

ROOT = Path(__file__).resolve().parents[1]


def _run_script(*args, timeout=600, devices=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("XLA_FLAGS", None)
    if devices:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_every_method_on_2x4_and_1x8_meshes_equals_one_device():
    proc = _run_script(str(ROOT / "tests" / "sharding_check.py"))
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = {(r["method"], r["path"], r["mesh"]) for r in rows if r["ok"]}
    for name in ("dense", "oracle", "streaming", "quest", "h2o", "kascade", "tsa", "tsa+kascade", "evosparse",
                 "butler"):
        for mesh in ("data=2,model=4", "model=8"):
            assert (name, "forward", mesh) in got, (name, mesh, rows)
    assert ("dense", "steps", "data=2,model=4") in got and ("dense", "generated", "data=2,model=4") in got
    # A batch of 3 rows on data=2 (rows whole, kernels run unsplit), and a known int layer under a mesh.
    assert {r["method"] for r in rows if r.get("batch") == 3 and r["ok"]} == \
        {"quest", "kascade", "tsa+kascade", "evosparse", "butler"}, rows
    assert ("sparse_decode", "int_layer", "data=2,model=4") in got, rows
    # bf16 on 1x8, within the bf16 tolerance (relative to the largest logit)
    assert {r["method"] for r in rows if r.get("dtype") == "bfloat16" and r["ok"]} == {"oracle", "h2o"}, rows
    # The cross-device collectives of every method's compiled forward on 1x8 are the expected ones (checked in
    # the script against its table: dense's, and what each method adds).
    checked = {r["method"] for r in rows
               if r["mesh"] == "model=8" and r["path"] == "forward" and r.get("collectives_ok")}
    assert checked == {"dense", "oracle", "streaming", "quest", "h2o", "kascade", "tsa", "tsa+kascade", "evosparse",
                       "butler"}, rows


def test_parse_mesh_and_errors():
    assert sharding.parse_mesh("data=2,model=4") == {"data": 2, "model": 4}
    assert sharding.parse_mesh("model=8") == {"data": 1, "model": 8}
    with pytest.raises(ValueError, match="'tensor=2' is not AXIS=SIZE"):
        sharding.parse_mesh("tensor=2")
    with pytest.raises(ValueError, match="model='x', expected a positive integer"):
        sharding.parse_mesh("model=x")
    with pytest.raises(ValueError, match="given twice"):
        sharding.parse_mesh("model=2,model=2")
    assert sharding.parse_mesh(" model = 08 ") == {"data": 1, "model": 8}
    for bad in ("+2", "2_0", "\u0664", "-1", "0", "1e3", "0x2"):  # ASCII digits only (int() takes the first three)
        with pytest.raises(ValueError, match=re.escape(f"data={bad!r}, expected a positive integer")):
            sharding.parse_mesh(f"data={bad}")
    with pytest.raises(ValueError, match="devices is empty"):
        sharding.make_mesh("model=1", devices=[])
    with pytest.raises(ValueError, match="= 8 devices, but 1 are available"):
        sharding.make_mesh("data=2,model=4")
    mesh = sharding.make_mesh("model=1")
    assert dict(mesh.shape) == {"data": 1, "model": 1}


def test_heads_must_divide_the_model_axis():
    import jax
    cfg = ModelConfig(architecture="llama", vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=2,
                      num_heads=9, num_kv_heads=3, head_dim=16, max_position_embeddings=128)
    # The sizes named are those that split the heads and divide the device count (3 on 2 devices cannot be made).
    for shape, sizes in (((1, 2), r"\[1\] \(with data = 2 / model\)"), ((1, 6), r"\[1, 3\] \(with data = 6 / model\)")):
        mesh = jax.sharding.AbstractMesh(shape, ("data", "model"))
        with pytest.raises(ValueError, match=rf"num_heads \(Hq\)=9 is not divisible by the mesh's model axis of "
                                             rf"{shape[1]}.*use model in {sizes}"):
            sharding.check_heads(cfg, mesh)
    with pytest.raises(ValueError, match="batch of 3 rows is not divisible by the mesh's data axis of 2"):
        sharding.check_batch(3, jax.sharding.AbstractMesh((2, 1), ("data", "model")))


def test_axis_table_specs():
    import jax
    mesh = jax.sharding.AbstractMesh((2, 4), ("data", "model"))
    P = jax.sharding.PartitionSpec
    assert sharding.logical_spec(("layers", "embed", "heads", "head_dim"), (2, 64, 16, 8), mesh) == \
        P(None, None, "model")
    assert sharding.logical_spec(("layers", "batch", "kv_heads", "length", "head_dim"), (2, 2, 8, 64, 8), mesh) == \
        P(None, "data", "model")
    # A vocabulary that does not divide the model axis is replicated; a head axis is an error.
    assert sharding.logical_spec(("vocab", "embed"), (49154, 64), mesh) == P()
    with pytest.raises(ValueError, match="axis 'kv_heads' of size 3"):
        sharding.logical_spec(("layers", "embed", "kv_heads", "head_dim"), (2, 64, 3, 8), mesh)
    assert sharding.state_axes((3, 2, 8, 10), _cfg8(), 2) == (None, "batch", "kv_heads", None)
    assert sharding.state_axes((2, 8, 5, 4), _cfg8(), 2) == ("batch", "kv_heads", None, None)
    assert sharding.state_axes((3, 2), _cfg8(), 2) == (None, "batch")
    # L == B: a leading axis of that size is the layers' when the dims after it read as [B, heads, ...]
    cfg2 = dataclasses.replace(_cfg8(), num_layers=2)
    assert sharding.state_axes((2, 2, 8, 10), cfg2, 2) == (None, "batch", "kv_heads", None)
    assert sharding.state_axes((2, 2), cfg2, 2) == (None, "batch")
    assert sharding.state_axes((2, 8, 5, 4), cfg2, 2) == ("batch", "kv_heads", None, None)


def _cfg8():
    return ModelConfig(architecture="llama", vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=3,
                       num_heads=16, num_kv_heads=8, head_dim=16, max_position_embeddings=128)


BENCH_SMOKE = """
import json, sys
from eval.bench import sharded
sharded.main(["--tiny", "--devices", "4", "--methods", "dense,kascade", "--out", sys.argv[1] + "/sharded.json"])
sharded.main(["--tiny", "--compare-unsharded", "--methods", "dense", "--out", sys.argv[1] + "/compare.json"])
"""


def test_bench_sharded_tiny_runs_on_cpu(tmp_path):
    proc = _run_script("-c", BENCH_SMOKE, str(tmp_path), devices=8)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rec = json.loads((tmp_path / "sharded.json").read_text())
    assert rec["benchmark"] == "sharded_decode" and rec["commit"] and rec["device"]
    rows = {(r["devices"], r["method"]): r for r in rec["rows"]}
    assert set(rows) == {(4, "dense"), (4, "kascade")} and rows[(4, "dense")]["mesh"] == "data=1,model=4"
    assert all("error" not in r and r["tokens_per_s"] > 0 for r in rows.values()), rec["rows"]
    # The floor per device: a quarter of the weights (norms replicated) and of the KV; the sparse method's is lower.
    from eval.bench.sharded import TINY
    weights = 4 * (TINY.num_params() - TINY.num_layers * 2 * TINY.hidden_size - TINY.hidden_size)
    kv = 2 * TINY.num_layers * 2 * TINY.num_kv_heads * 96 * TINY.head_dim * 4
    assert (weights + kv) / 4 <= rows[(4, "dense")]["floor_bytes_per_device"] < (weights + kv) / 4 * 1.05
    assert rows[(4, "kascade")]["floor_bytes_per_device"] < rows[(4, "dense")]["floor_bytes_per_device"]
    cmp = json.loads((tmp_path / "compare.json").read_text())
    (row,) = cmp["rows"]
    assert row["method"] == "dense" and row["unsharded_step_ms"] > 0 and row["mesh1_step_ms"] > 0


def test_cli_mesh_errors_name_the_device_count(capsys):
    from jsparse.cli import main
    assert main(["generate", "--prompt", "hi", "--mesh", "data=2,model=4"]) == 2
    assert "data=2 x model=4 = 8 devices, but 1 are available" in capsys.readouterr().err
    assert main(["generate", "--prompt", "hi", "--mesh", "model=four"]) == 2
    assert "model='four', expected a positive integer" in capsys.readouterr().err


def test_triton_kernels_lower_per_shard_for_cuda_on_a_2x4_mesh():
    """On an abstract 2x4 mesh of H100s, the Pallas GPU kernels lower for CUDA inside a shard_map (a manual
    computation holding the Triton call: XLA never sees a custom call it would have to replicate), and the
    retrieval block max carries its pmax over `model`."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas import triton as plgpu
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

    from pallas_kernels.anchor_attention.api import anchor_decode
    from pallas_kernels.block_scores.api import block_max_scores
    from pallas_kernels.dense_decode.api import dense_decode_stacked
    from pallas_kernels.sparse_attention.api import sparse_decode
    from tests.lowering import H100

    device = AbstractDevice(device_kind=H100[0], num_cores=H100[1], platform="gpu")
    mesh = AbstractMesh((2, 4), ("data", "model"), (AxisType.Auto,) * 2, abstract_device=device)
    B, Hq, Hkv, N, D, K, L = 2, 16, 8, 256, 128, 32, 3
    sds = jax.ShapeDtypeStruct
    args = (sds((B, 1, Hq, D), jnp.bfloat16), sds((L, B, Hkv, N, D), jnp.bfloat16),
            sds((L, B, Hkv, N, D), jnp.bfloat16), sds((), jnp.int32), sds((B, Hkv, 1, K), jnp.int32),
            sds((B,), jnp.int32))

    def retrieval(q, k, v, layer, idx, lengths):
        pos = lengths[:, None] - 1
        return block_max_scores(q, k, layer, jnp.array([1, 6], jnp.int32), jnp.ones((2, Hq // Hkv), bool), pos,
                                jnp.zeros_like(pos), pos // 16 + 1, block_size=16, implementation="pallas_gpu")

    ops = {
        "sparse_decode": lambda q, k, v, layer, idx, n: sparse_decode(q, k, v, idx, n, layer=layer,
                                                                      implementation="pallas_gpu"),
        "dense_decode_stacked": lambda q, k, v, layer, idx, n: dense_decode_stacked(q, k, v, layer, n,
                                                                                    implementation="pallas_gpu"),
        "anchor_decode": lambda q, k, v, layer, idx, n: anchor_decode(q, k, v, n, budget=0.1, min_tokens=16,
                                                                      layer=layer, implementation="pallas_gpu"),
        "block_max_scores": retrieval,
    }
    check = [jax.export.DisabledSafetyCheck.custom_call(plgpu.CUSTOM_CALL_TARGET_NAME)]
    with use_abstract_mesh(mesh):
        for name, fn in ops.items():
            text = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=check)(*args).mlir_module()
            manual = text[text.index("sdy.manual_computation"):] if "sdy.manual_computation" in text else ""
            assert plgpu.CUSTOM_CALL_TARGET_NAME in manual or "triton" in manual, name
            if name == "block_max_scores":
                assert "all_reduce" in manual, name


def test_evosparse_select_kernel_lowers_per_shard_for_cuda():
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas import triton as plgpu
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

    from pallas_kernels.block_scores.api import select_blocks
    from tests.lowering import H100

    device = AbstractDevice(device_kind=H100[0], num_cores=H100[1], platform="gpu")
    mesh = AbstractMesh((2, 4), ("data", "model"), (AxisType.Auto,) * 2, abstract_device=device)
    B, Hkv, nb, L = 2, 8, 256, 3
    sds = jax.ShapeDtypeStruct
    args = (sds((L, B, Hkv, nb), jnp.float32), sds((B,), jnp.int32), sds((B,), jnp.int32), sds((B,), jnp.bool_),
            sds((), jnp.int32))

    def f(heat, n_s, hi, full, layer):
        return select_blocks(heat, None, n_s, hi, hi + 2, n_s + 4, full, num_kv_heads=Hkv, nb=nb, width=16,
                             heat_width=8, layer=layer, implementation="pallas_gpu")
    check = [jax.export.DisabledSafetyCheck.custom_call(plgpu.CUSTOM_CALL_TARGET_NAME)]
    with use_abstract_mesh(mesh):
        text = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=check)(*args).mlir_module()
    assert "triton" in text[text.index("sdy.manual_computation"):]


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_topk_select_runs_per_shard_on_a_2x4_mesh(platform):
    """STS's exact top-k (`topk_select`, Pallas on GPU and TPU) on an abstract 2x4 mesh: the kernel sits inside
    the shard_map's manual computation (each device selects over its own rows and heads) and no collective
    gathers the scores."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas import triton as plgpu
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

    from pallas_kernels.topk_select import topk_select
    from tests.lowering import H100, TPU_V5E

    kind = H100 if platform == "cuda" else TPU_V5E
    device = AbstractDevice(device_kind=kind[0], num_cores=kind[1], platform=kind[2])
    mesh = AbstractMesh((2, 4), ("data", "model"), (AxisType.Auto,) * 2, abstract_device=device)
    impl = "pallas_gpu" if platform == "cuda" else "pallas_tpu"
    scores = jax.ShapeDtypeStruct((2, 8, 1024), jnp.float32)
    k = jax.ShapeDtypeStruct((2, 1), jnp.int32)
    check = [jax.export.DisabledSafetyCheck.custom_call(plgpu.CUSTOM_CALL_TARGET_NAME)] if platform == "cuda" else []
    with use_abstract_mesh(mesh):
        text = jax.export.export(jax.jit(lambda s, k: topk_select(s, k, 96, implementation=impl)),
                                 platforms=[platform], disabled_checks=check)(scores, k).mlir_module()
    manual = text[text.index("sdy.manual_computation"):]
    assert ("triton" if platform == "cuda" else "tpu_custom_call") in manual
    assert "all_gather" not in text and "all_reduce" not in text


def test_an_op_whose_rows_do_not_divide_the_mesh_runs_whole():
    """`per_shard` runs an op whole when a split dim does not divide its mesh axis (one batch row on data=2).
    The op's entry point, called again from there, must not split it again: that recursed without end."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AbstractMesh, AxisType, use_abstract_mesh

    from pallas_kernels import sharding as kshard
    from pallas_kernels.block_scores import sparse_decode_mass

    sds = jax.ShapeDtypeStruct
    L, B, Hq, Hkv, D, N, K = 2, 1, 8, 4, 16, 64, 8
    args = (sds((B, 1, Hq, D), jnp.float32), sds((L, B, Hkv, N, D), jnp.float32), sds((L, B, Hkv, N, D), jnp.float32),
            sds((), jnp.int32), sds((L, B, Hkv, 1, K), jnp.int32), sds((B,), jnp.int32))
    with use_abstract_mesh(AbstractMesh((2, 4), ("data", "model"), (AxisType.Explicit,) * 2)):
        assert kshard.active_mesh() is not None
        out, mass = jax.eval_shape(sparse_decode_mass, *args)
        assert kshard.active_mesh() is not None  # the fallback's no-mesh context ended with it
    assert out.shape == (B, 1, Hq, D) and mass.shape == (B, Hkv, 1, K)


def test_make_mesh_refuses_more_devices_than_the_spec_uses():
    import jax
    two = [jax.devices()[0]] * 2  # two device entries; a mesh of one must not silently take them
    with pytest.raises(sharding.ShardingError, match=r"mesh data=1 x model=1 = 1 devices, but 2 are available"):
        sharding.make_mesh("model=1", devices=two)


def test_kv_heads_must_divide_the_model_axis_too():
    import jax
    cfg = ModelConfig(architecture="llama", vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=2,
                      num_heads=8, num_kv_heads=2, head_dim=8, max_position_embeddings=128)
    mesh = jax.sharding.AbstractMesh((1, 4), ("data", "model"))
    with pytest.raises(sharding.ShardingError, match=re.escape(
            "num_kv_heads (Hkv)=2 is not divisible by the mesh's model axis of 4") + r".*use model in \[1, 2\]"):
        sharding.check_heads(cfg, mesh)


def test_placer_names_an_unknown_tensor():
    cfg = ModelConfig(architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=128)
    place = sharding.placer(cfg, sharding.make_mesh("model=1"))
    with pytest.raises(sharding.ShardingError,
                       match=r"no sharding for tensor 'layers\.wqkv': expected one of .*'layers\.wq'"):
        place("layers.wqkv", np.zeros((2, 32, 32), np.float32))
    got = place("layers.wq", np.arange(2 * 32 * 4 * 8, dtype=np.float32).reshape(2, 32, 4, 8))
    np.testing.assert_array_equal(np.asarray(got), np.arange(2 * 32 * 4 * 8, dtype=np.float32).reshape(2, 32, 4, 8))


def test_state_axes_shard_a_per_query_head_axis():
    cfg = ModelConfig(architecture="llama", vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=3,
                      num_heads=16, num_kv_heads=8, head_dim=16, max_position_embeddings=128)
    assert sharding.state_axes((2, 16, 5), cfg, 2) == ("batch", "heads", None)
    assert sharding.state_axes((3, 2, 16, 5), cfg, 2) == (None, "batch", "heads", None)


def test_state_axes_take_a_leading_layer_axis_when_no_head_axis_follows():
    # L == B == 2 and a state [L, B, N] (no head dim): the leading axis is the layers', the batch is dim 1.
    cfg = ModelConfig(architecture="llama", vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=2,
                      num_heads=16, num_kv_heads=8, head_dim=16, max_position_embeddings=128)
    assert sharding.state_axes((2, 2, 10), cfg, 2) == (None, "batch", None)


def test_state_axes_find_the_batch_behind_a_leading_axis_of_another_size():
    # A leading per-layer axis that is neither L nor B (a state kept for 5 of the layers only): batch is dim 1.
    cfg = ModelConfig(architecture="llama", vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=3,
                      num_heads=16, num_kv_heads=8, head_dim=16, max_position_embeddings=128)
    assert sharding.state_axes((5, 2, 8, 4), cfg, 2) == (None, "batch", "kv_heads", None)


SHARD_BATCH_ODD = """
import numpy as np
from models import sharding
mesh = sharding.make_mesh("data=2")
x = sharding.shard_batch(np.arange(8).reshape(4, 2), mesh)
assert x.sharding.spec == sharding.batch_sharding(mesh, 2).spec and (np.asarray(x) == np.arange(8).reshape(4, 2)).all()
try:
    sharding.shard_batch(np.zeros((3, 2), np.int32), mesh)
except sharding.ShardingError as e:
    print("ERROR:", e)
"""


def test_shard_batch_refuses_rows_that_do_not_divide_the_data_axis():
    proc = _run_script("-c", SHARD_BATCH_ODD, devices=2, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ERROR: batch of 3 rows is not divisible by the mesh's data axis of 2" in proc.stdout, proc.stdout


def test_head_error_names_sizes_for_the_whole_device_count():
    # data=3 x model=2: 6 devices, so model=3 (with data=2) is a fit to suggest, though it does not divide model=2.
    import jax
    cfg = ModelConfig(architecture="llama", vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=2,
                      num_heads=9, num_kv_heads=3, head_dim=16, max_position_embeddings=128)
    mesh = jax.sharding.AbstractMesh((3, 2), ("data", "model"))
    with pytest.raises(sharding.ShardingError, match=re.escape("use model in [1, 3] (with data = 6 / model)")):
        sharding.check_heads(cfg, mesh)


@pytest.mark.parametrize("argv,message", [
    (["--tiny", "--context", "512", "--dtype", "bfloat16"], "--context, --dtype with --tiny, which sets them"),
    (["--compare-unsharded", "--devices", "2"], "--devices with --compare-unsharded: it times one device"),
])
def test_bench_sharded_refuses_options_it_would_override(argv, message, capsys):
    from eval.bench import sharded
    with pytest.raises(SystemExit):
        sharded.main(argv)
    assert message in capsys.readouterr().err
