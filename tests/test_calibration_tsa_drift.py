"""TSA's calibration drift is one mean over every valid token of all prompts (tsa_calibration docstring: a longer
prompt weighs more; not a mean of per-prompt means). The suite's batching test used rows of one length, where a
per-row and a per-token weighting agree, so weighting batches by rows instead of valid tokens went unnoticed."""

import jax
import jax.numpy as jnp
import numpy as np

from jsparse.methods import tsa_calibration as tcal
from models.config import ModelConfig
from models.params import random_params

CFG = ModelConfig(architecture="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512, eos_token_ids=(3,))


def test_drift_is_a_token_mean_over_prompts_of_different_lengths():
    params = random_params(CFG, jax.random.key(0), jnp.float32, scale=0.3)
    short = np.asarray(jax.random.randint(jax.random.key(1), (1, 8), 4, CFG.vocab_size), np.int32)
    long = np.asarray(jax.random.randint(jax.random.key(2), (1, 56), 4, CFG.vocab_size), np.int32)
    d_short = tcal.calibrate(params, CFG, [short], delta=1.0).arrays["drift"].astype(np.float64)
    d_long = tcal.calibrate(params, CFG, [long], delta=1.0).arrays["drift"].astype(np.float64)
    assert not np.allclose(d_short, d_long, rtol=1e-2)  # the weighting matters for these prompts
    want = (8 * d_short + 56 * d_long) / 64  # every token counts once
    separate = tcal.calibrate(params, CFG, [short, long], delta=1.0).arrays["drift"]
    np.testing.assert_allclose(separate, want, rtol=1e-5)
    # One right-padded batch of both rows (lengths 8 and 56) gives the same token mean.
    padded = np.concatenate([np.pad(short, ((0, 0), (0, 48)), constant_values=5), long])
    batched = tcal.calibrate(params, CFG, [(padded, np.asarray([8, 56], np.int32))], delta=1.0).arrays["drift"]
    np.testing.assert_allclose(batched, want, rtol=1e-5)
