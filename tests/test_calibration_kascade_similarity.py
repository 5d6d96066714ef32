"""Kascade's similarity sim[l1, l2, h1, h2] is the share of layer l2's (tile-pooled, before-the-tile) attention mass
that layer l1's top-k indices recover: P is normalised over the keys before each tile (kascade_calibration
docstring), so every similarity, plain or wide, lies in [0, 1]. The suite checked shares (ratios, where the scale
cancels in part) and shapes, so dropping P's normalisation (similarities up to ~17 on this model) went unnoticed."""

import jax
import jax.numpy as jnp
import numpy as np

from jsparse.methods.kascade_calibration import calibrate
from models.config import ModelConfig
from models.params import random_params

CFG = ModelConfig(architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=4,
                  num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=512)


def test_similarities_are_fractions_of_a_mass():
    params = random_params(CFG, jax.random.key(0), jnp.float32, scale=0.5)
    rows = [np.asarray(jax.random.randint(jax.random.key(i), (1, 128), 0, 64)) for i in range(2)]
    art = calibrate(params, CFG, rows, budget=0.1, tile=16, min_tokens=8)
    for name in ("similarity", "similarity_wide"):
        s = art.arrays[name]
        assert s.min() >= 0.0 and s.max() <= 1.0 + 1e-5, (name, s.min(), s.max())
    # The wider sets (reuse_scale * k keys, a superset per tile) recover at least as much.
    assert np.all(art.arrays["similarity_wide"] >= art.arrays["similarity"] - 1e-5)
