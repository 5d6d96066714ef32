"""loss.jsonl's `grad_norm` is the global norm of the step's gradient (before clipping), and `loss` the step's loss:
checked for step 1 against an independent computation (jax.grad of the per-layer reference MSE on batch 0 from the
seeded initial predictor). The suite never read grad_norm, so logging the norm of the optimizer's update instead
(0 at step 1, whose warmup learning rate is 0) went unnoticed."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from models.params import random_params
from pallas_kernels.logit_mse.reference import logit_mse_reference
from train.data import ChunkStream
from train.loop import TrainConfig, predictor_qk, record_qk, train
from train.predictor import init_params, preset_config

CFG = ModelConfig(architecture="llama", vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512)
T = 32


def test_step_one_logs_the_gradient_norm_and_loss(tmp_path):
    params = random_params(CFG, jax.random.key(0), jnp.float32, 0.2)
    pcfg = preset_config(CFG, "auto")
    chunks = np.random.default_rng(0).integers(0, CFG.vocab_size, (5, T)).astype(np.int32)
    tc = TrainConfig(seq_len=T, steps=2, batch_size=2, warmup_steps=1, checkpoint_every=10, seed=3,
                     clip_norm=1e-3)  # clipping binds: the logged norm is the raw gradient's
    out = str(tmp_path / "run")
    train(CFG, params, fingerprint="fp", chunks=chunks, out_dir=out, tc=tc, pcfg=pcfg, progress=False)
    with open(os.path.join(out, "loss.jsonl")) as f:
        first = json.loads(f.readline())

    tokens = jnp.asarray(ChunkStream(chunks, tc.batch_size, tc.seed).batch(0))
    h0, q, k = record_qk(params, CFG, tokens)
    p0 = init_params(pcfg, jax.random.key(tc.seed))

    def loss(p):
        qp, kp = predictor_qk(p, pcfg, h0)
        return jnp.mean(logit_mse_reference(q, k, qp, kp, causal=True))

    want_loss, grads = jax.value_and_grad(loss)(p0)
    want_norm = float(np.sqrt(sum(np.sum(np.square(np.asarray(g, np.float64))) for g in jax.tree.leaves(grads))))
    assert want_norm > 10 * tc.clip_norm
    np.testing.assert_allclose(first["loss"], float(want_loss), rtol=1e-4)
    np.testing.assert_allclose(first["grad_norm"], want_norm, rtol=1e-3)
