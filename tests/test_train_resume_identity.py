"""Resuming a checkpoint refuses every changed hyper-parameter of the run's identity (TrainConfig docstring: all
fields except checkpoint_every, keep_checkpoints, loss_impl and interpret). The suite only tried learning_rate and
seq_len, so dropping e.g. end_lr_ratio from `identity()` (a resumed run would silently finish under another
schedule) went unnoticed."""

import dataclasses
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import ModelConfig
from models.params import random_params
from train.loop import TrainConfig, TrainError, train
from train.predictor import preset_config

CFG = ModelConfig(architecture="llama", vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512)
T = 32
TC = TrainConfig(seq_len=T, steps=4, batch_size=2, warmup_steps=1, checkpoint_every=2, learning_rate=1e-2)
MAY_CHANGE = {"checkpoint_every", "keep_checkpoints", "loss_impl", "interpret"}


def test_identity_is_every_field_but_the_changeable_ones():
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    assert set(TC.identity()) == names - MAY_CHANGE
    for name in names - MAY_CHANGE:
        assert TC.identity()[name] == getattr(TC, name)


class Crash(Exception):
    pass


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """A run that crashed after step 2 (checkpoint of step 2 on disk)."""
    params = random_params(CFG, jax.random.key(0), jnp.float32, 0.2)
    pcfg = preset_config(CFG, "auto")
    chunks = np.random.default_rng(0).integers(0, CFG.vocab_size, (5, T)).astype(np.int32)
    out = str(tmp_path_factory.mktemp("run"))

    def crash(step, loss):
        if step == 2:
            raise Crash()

    with pytest.raises(Crash):
        train(CFG, params, fingerprint="fp", chunks=chunks, out_dir=out, tc=TC, pcfg=pcfg, progress=False,
              on_step=crash)
    return out, params, pcfg, chunks


@pytest.mark.parametrize("change", [{"end_lr_ratio": 0.5}, {"weight_decay": 0.05}, {"clip_norm": 0.5},
                                    {"warmup_steps": 2}, {"steps": 5}, {"seed": 1}, {"causal": False}])
def test_resume_with_another_schedule_or_optimizer_setting_is_refused(tmp_path, interrupted, change):
    src, params, pcfg, chunks = interrupted
    out = str(tmp_path / "copy")
    shutil.copytree(src, out)
    (name, _), = change.items()
    with pytest.raises(TrainError, match=f"another training config.*{name}"):
        train(CFG, params, fingerprint="fp", chunks=chunks, out_dir=out, tc=dataclasses.replace(TC, **change),
              pcfg=pcfg, progress=False)
