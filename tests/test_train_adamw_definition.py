"""The optimizer `train` applies, checked against AdamW written out by its definition for the first two steps:
clip the gradient to global norm clip_norm, then Adam moments (b1 0.9, b2 0.999, eps 1e-8, bias-corrected),
decoupled weight decay, and the schedule's rate (update i uses schedule(i): 0 for the first update under
warmup, the peak for the second with warmup_steps=1). The suite compared runs only with each other and the loss log's
lr with `make_schedule` itself (computed apart from the optimizer), so an optimizer built with a constant rate or
with clipping after Adam went unnoticed."""

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


def test_two_steps_equal_clipped_adamw(tmp_path):
    params = random_params(CFG, jax.random.key(0), jnp.float32, 0.2)
    pcfg = preset_config(CFG, "auto")
    chunks = np.random.default_rng(0).integers(0, CFG.vocab_size, (5, T)).astype(np.int32)
    tc = TrainConfig(seq_len=T, steps=2, batch_size=2, warmup_steps=1, checkpoint_every=10, seed=1,
                     learning_rate=1e-2, weight_decay=0.1, clip_norm=1e-3)
    res = train(CFG, params, fingerprint="fp", chunks=chunks, out_dir=str(tmp_path / "run"), tc=tc, pcfg=pcfg,
                progress=False)

    stream = ChunkStream(chunks, tc.batch_size, tc.seed)
    p0 = jax.tree.map(lambda x: np.asarray(x, np.float64), init_params(pcfg, jax.random.key(tc.seed)))

    def grad_at(p, step):
        h0, q, k = record_qk(params, CFG, jnp.asarray(stream.batch(step)))

        def loss(pp):
            qp, kp = predictor_qk(pp, pcfg, h0)
            return jnp.mean(logit_mse_reference(q, k, qp, kp, causal=True))

        g = jax.tree.map(lambda x: np.asarray(x, np.float64),
                         jax.grad(loss)(jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), p)))
        norm = np.sqrt(sum(np.sum(x * x) for x in jax.tree.leaves(g)))
        assert norm > tc.clip_norm  # the clip binds
        return jax.tree.map(lambda x: x * (tc.clip_norm / norm), g)

    b1, b2, eps = 0.9, 0.999, 1e-8
    # Update 1 (rate schedule(0) = 0): the parameters stay; the moments take the first gradient.
    g1 = grad_at(p0, 0)
    m = jax.tree.map(lambda g: (1 - b1) * g, g1)
    v = jax.tree.map(lambda g: (1 - b2) * g * g, g1)
    # Update 2 (rate schedule(1) = the peak): gradient at the unchanged parameters on batch 1.
    g2 = grad_at(p0, 1)
    m = jax.tree.map(lambda a, g: b1 * a + (1 - b1) * g, m, g2)
    v = jax.tree.map(lambda a, g: b2 * a + (1 - b2) * g * g, v, g2)
    lr = tc.learning_rate
    want = jax.tree.map(lambda p, a, s: p - lr * ((a / (1 - b1 ** 2)) / (np.sqrt(s / (1 - b2 ** 2)) + eps)
                                                  + tc.weight_decay * p), p0, m, v)
    for got, w, p in zip(jax.tree.leaves(res.params), jax.tree.leaves(want), jax.tree.leaves(p0)):
        got = np.asarray(got, np.float64)
        # The step moved the parameters by about lr per entry: compare the moves (tolerance << lr).
        np.testing.assert_allclose(got - p, w - p, atol=lr * 2e-2)
