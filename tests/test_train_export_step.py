"""A rerun of a finished run keeps out_dir's artifact only when it is that run's export: a butler artifact of the
fingerprint *that records the run's step count* and whose arrays equal the params (`_is_export`; train/loop.py's
docstring: "any other artifact there (... an earlier export) is replaced by a fresh export"). The suite only tried
a kept artifact and a missing one, so `_is_export` ignoring the recorded step count went unnoticed."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from models.params import random_params
from train.loop import TrainConfig, train
from train.predictor import preset_config

CFG = ModelConfig(architecture="llama", vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512)
T = 32


def test_rerun_replaces_an_artifact_recording_another_step(tmp_path):
    params = random_params(CFG, jax.random.key(0), jnp.float32, 0.2)
    pcfg = preset_config(CFG, "auto")
    chunks = np.random.default_rng(0).integers(0, CFG.vocab_size, (5, T)).astype(np.int32)
    tc = TrainConfig(seq_len=T, steps=2, batch_size=2, warmup_steps=0, checkpoint_every=10)
    out = str(tmp_path / "run")
    train(CFG, params, fingerprint="fp", chunks=chunks, out_dir=out, tc=tc, pcfg=pcfg, progress=False)
    path = os.path.join(out, "artifact.json")
    with open(path) as f:
        info = json.load(f)
    assert info["meta"]["steps"] == 2
    info["meta"]["steps"] = 1  # an artifact that says it is another step's export (same arrays)
    info["meta"]["dense_set"] = [1]
    with open(path, "w") as f:
        json.dump(info, f)
    res = train(CFG, params, fingerprint="fp", chunks=chunks, out_dir=out, tc=tc, pcfg=pcfg, progress=False)
    assert res.start_step == res.last_step == 2 and res.losses == []
    with open(path) as f:
        meta = json.load(f)["meta"]
    assert meta["steps"] == 2 and "dense_set" not in meta  # replaced by a fresh export
