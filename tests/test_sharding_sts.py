"""STS and speculative decoding on a mesh: the draft and the target sharded on the same 2x4 and 1x8 meshes equal
one device (tests/sts_sharding_check.py, in a fresh process with 8 CPU devices), and the errors of a draft that
cannot share the target's mesh (in-process, one device)."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import pytest

from jsparse.api import generate_ids, on_mesh
from models import sharding
from models.bundled import LoadedModel, keep_layers
from models.config import ModelConfig
from models.params import random_params
from models.speculative import sharded_speculative_generate
from tests.test_sharding import ROOT, _run_script

CFG = ModelConfig(architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=128)


def test_sts_prefill_round_generation_and_session_on_2x4_and_1x8_meshes_equal_one_device():
    proc = _run_script(str(ROOT / "tests" / "sts_sharding_check.py"))
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = {(r["check"], r["mesh"]) for r in rows if r.get("ok")}
    for check, mesh in (("forward", "data=2,model=4"), ("forward", "model=8"), ("generated", "data=2,model=4"),
                        ("session", "data=2,model=4"), ("session", "model=8")):  # session on 2x4: the one-row error
        assert (check, mesh) in got, (check, mesh, rows)
    # STS's cross-head step in the HLO: the rows a target layer reads, gathered across `model`, never the record.
    assert any(r.get("collectives_ok") for r in rows if (r["check"], r["mesh"]) == ("forward", "model=8")), rows


@pytest.fixture(scope="module")
def tiny():
    return LoadedModel(cfg=CFG, params=random_params(CFG, jax.random.key(0), jnp.float32), tokenizer=None,
                       name="tiny")


def test_draft_must_share_the_targets_mesh(tiny):
    on_one = on_mesh(tiny, "model=1")
    with pytest.raises(ValueError, match="the target is on a mesh data=1,model=1 and the draft on one device"):
        generate_ids(on_one, [[1, 2, 3]], max_new_tokens=2, draft=tiny)
    with pytest.raises(ValueError, match="the target is on one device .no mesh. and the draft on a mesh"):
        generate_ids(tiny, [[1, 2, 3]], max_new_tokens=2, draft=on_one)
    # A layer-skipped draft of a model on a mesh stays on it (what `--draft SPEC:layers=...` loads).
    skipped = keep_layers(on_one, [1])
    assert skipped.mesh is on_one.mesh and skipped.cfg.num_layers == 1
    assert skipped.params.layers.wq.sharding == sharding.param_shardings(skipped.cfg, on_one.mesh).layers.wq


def test_draft_heads_must_divide_the_model_axis(tiny):
    draft_cfg = dataclasses.replace(CFG, num_heads=3, num_kv_heads=3)
    mesh = jax.sharding.AbstractMesh((1, 2), ("data", "model"))
    tokens = jnp.zeros((2, 4), jnp.int32)
    with pytest.raises(sharding.ShardingError, match=r"on a mesh: the draft's num_heads \(Hq\)=3 is not divisible "
                                                     r"by the mesh's model axis of 2"):
        sharded_speculative_generate(mesh, tiny.params, None, None, None, tokens, jnp.full((2,), 4), None,
                                     t_cfg=CFG, d_cfg=draft_cfg, gamma=2, max_new_tokens=2, capacity=16)
