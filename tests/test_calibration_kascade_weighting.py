"""Kascade's calibration statistics (similarity, similarity_wide, importance) are means over the prompts, every
prompt counting once however the prompts are batched (kascade_calibration docstring: "averaged over prompts"). The
suite's batching test compared two batches of one row with one batch of two, where weighting only the first batch by
its rows gives the same result; batches of unequal sizes tell them apart."""

import jax
import jax.numpy as jnp
import numpy as np

from jsparse.methods.kascade_calibration import calibrate
from models.config import ModelConfig
from models.params import random_params

CFG = ModelConfig(architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=4,
                  num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=512)
KW = dict(budget=0.1, tile=16, min_tokens=8, target_share=0.97, reuse_scale=2.0)
NAMES = ("similarity", "similarity_wide", "importance")


def test_every_prompt_counts_once_in_batches_of_unequal_size():
    params = random_params(CFG, jax.random.key(0), jnp.float32, scale=0.5)
    rows = [np.asarray(jax.random.randint(jax.random.key(i), (1, 128), 0, 64)) for i in range(3)]
    each = [calibrate(params, CFG, [r], **KW) for r in rows]
    want = {n: np.mean([a.arrays[n].astype(np.float64) for a in each], axis=0) for n in NAMES}
    assert not np.allclose(each[0].arrays["similarity"], each[1].arrays["similarity"], atol=1e-3)
    for batches in ([rows[0], np.concatenate(rows[1:])], [np.concatenate(rows[:2]), rows[2]], rows,
                    [np.concatenate(rows)]):
        art = calibrate(params, CFG, batches, **KW)
        assert art.meta["prompts"] == 3
        for n in NAMES:
            np.testing.assert_allclose(art.arrays[n], want[n], rtol=1e-5, atol=1e-6)
