"""max_seconds: a run whose time budget runs out on a step before the last stops early (stopped_early, a
checkpoint and the artifact of that step); one whose budget runs out on its last step has finished every planned
step and is not 'stopped early' (TrainResult and the artifact's meta say so). The suite never ran with
max_seconds, so `and step < tc.steps` could be dropped unnoticed (a completed run then reported as cut short)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import ModelConfig
from models.params import random_params
from train.loop import TrainConfig, read_checkpoint_meta, train
from train.predictor import preset_config

CFG = ModelConfig(architecture="llama", vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512)
T = 32


@pytest.fixture(scope="module")
def setup():
    params = random_params(CFG, jax.random.key(0), jnp.float32, 0.2)
    chunks = np.random.default_rng(0).integers(0, CFG.vocab_size, (5, T)).astype(np.int32)
    return params, preset_config(CFG, "auto"), chunks


@pytest.mark.parametrize("steps", [1, 2])
def test_stopped_early_only_when_steps_remain(tmp_path, setup, steps):
    params, pcfg, chunks = setup
    tc = TrainConfig(seq_len=T, steps=steps, batch_size=2, warmup_steps=0, checkpoint_every=10)
    out = str(tmp_path / "run")
    # A budget every step exceeds: the run stops after its first step.
    res = train(CFG, params, fingerprint="fp", chunks=chunks, out_dir=out, tc=tc, pcfg=pcfg, progress=False,
                max_seconds=1e-9)
    assert res.last_step == 1 and [s for s, _ in res.losses] == [1]
    want = steps > 1  # steps left after step 1
    assert res.stopped_early is want
    with open(os.path.join(out, "artifact.json")) as f:
        meta = json.load(f)["meta"]
    assert meta["stopped_early"] is want and meta["steps"] == 1 and meta["planned_steps"] == steps
    assert read_checkpoint_meta(out)["step"] == 1
