"""Reading Hugging Face configs where transformers is the definition (checked against it): a Qwen2 config without
layer_types and the use_sliding_window flag, llama3 RoPE's original context, the legacy rope_scaling "type" key,
rope_parameters' theta over a stale top-level one; init_cache's capacity check; ModelConfig's own checks and its
parameter count (mutation audits' survivors, each test failing on its mutant)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from models import llama
from models.cache import init_cache
from models.config import ConfigError, ModelConfig
from models.params import random_params


def _hf(use_sliding_window):
    return dict(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, sliding_window=16, max_window_layers=2,
                use_sliding_window=use_sliding_window)


def _transformers_windows(d):
    """Per layer window as transformers' Qwen2 config derives it (layer_types from use_sliding_window and
    max_window_layers; sliding_window kept only with use_sliding_window)."""
    c = transformers.Qwen2Config(**{k: v for k, v in d.items() if k != "model_type"})
    types = c.layer_types
    W = c.sliding_window
    return tuple(W if t == "sliding_attention" else 0 for t in types)


@pytest.mark.parametrize("use", [False, True])
def test_use_sliding_window_flag_without_layer_types(use):
    """Qwen2 configs without `layer_types` (as most Qwen2/2.5 checkpoints' config.json) that set sliding_window and
    max_window_layers < num_hidden_layers but use_sliding_window=false (e.g. Qwen2.5-0.5B: 24 layers,
    max_window_layers 21, sliding_window 32768, use_sliding_window false) must get NO window on any layer: transformers
    applies the window only with use_sliding_window."""
    d = _hf(use)
    assert "layer_types" not in d
    cfg = ModelConfig.from_hf(d)
    want = _transformers_windows(d)
    if use:
        assert want == (0, 0, 16, 16)
        assert cfg.layer_windows == want and cfg.sliding_window == 16
    else:
        assert not any(want)
        assert cfg.layer_windows == () and cfg.sliding_window is None
        assert not cfg.windows.any()


def test_llama3_top_level_original_context_wins():
    """llama3 RoPE: when a config gives original_max_position_embeddings both at the top level and inside rope_scaling
    with different values, transformers uses the top-level one (standardize_rope_params gives it priority). The
    frequencies must match transformers' llama3 init function."""
    d = dict(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096, rope_theta=10000.0,
             original_max_position_embeddings=64,
             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 1024})
    cfg = ModelConfig.from_hf(d)
    hf_cfg = transformers.LlamaConfig(**{k: v for k, v in d.items() if k != "model_type"})
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    assert cfg.rope.original_max_position == 64
    np.testing.assert_allclose(llama.rope_inv_freq(cfg), want.numpy(), rtol=1e-6)


def test_legacy_type_key_linear_scaling():
    """Older config.json files spell the RoPE scaling kind as rope_scaling={"type": ...} (not "rope_type"); transformers
    reads "type" as the rope type. A linear scaling given that way must be applied (frequencies divided by factor)."""
    d = dict(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
             num_attention_heads=2, rope_theta=10000.0, rope_scaling={"type": "linear", "factor": 4.0})
    cfg = ModelConfig.from_hf(d)
    assert (cfg.rope.rope_type, cfg.rope.factor) == ("linear", 4.0)
    D = cfg.head_dim
    base = 1.0 / (10000.0 ** (np.arange(0, D, 2, dtype=np.float32) / D))  # the definition: default / factor
    np.testing.assert_allclose(llama.rope_inv_freq(cfg), base / 4.0, rtol=1e-6)
    hf_cfg = transformers.LlamaConfig(**{k: v for k, v in d.items() if k != "model_type"})
    want, _ = ROPE_INIT_FUNCTIONS["linear"](hf_cfg, "cpu")
    np.testing.assert_allclose(llama.rope_inv_freq(cfg), want.numpy(), rtol=1e-6)


def test_rope_parameters_theta_wins_over_top_level():
    """A config giving theta in `rope_parameters` (transformers 5's place) and a different top-level `rope_theta` (a
    stale legacy key) runs with rope_parameters' theta in transformers (standardize_rope_params only fills theta in when
    rope_parameters lacks it). The frequencies must be transformers'."""
    d = dict(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
             num_attention_heads=2, rope_theta=10000.0, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    cfg = ModelConfig.from_hf(d)
    hf_cfg = transformers.LlamaConfig(**{k: v for k, v in d.items() if k != "model_type"})
    assert hf_cfg.rope_parameters["rope_theta"] == 1e6
    want, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(config=hf_cfg, device="cpu")
    assert cfg.rope.theta == 1e6
    np.testing.assert_allclose(llama.rope_inv_freq(cfg), want.numpy(), rtol=1e-6)


# init_cache refuses a capacity that holds no token (0 or negative), and gives the documented shapes otherwise.
CFG = ModelConfig(architecture="llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2,
                  num_heads=2, num_kv_heads=1, head_dim=8)


@pytest.mark.parametrize("capacity", [0, -1])
def test_empty_capacity_is_refused(capacity):
    with pytest.raises(ValueError, match="capacity"):
        init_cache(CFG, 1, capacity)


def test_capacity_one_is_a_cache():
    c = init_cache(CFG, 3, 1, jnp.float32)
    assert c.k.shape == c.v.shape == (2, 3, 1, 1, 8) and c.capacity == 1
    assert c.lengths.shape == (3,) and int(c.lengths.sum()) == 0


_LLAMA = dict(architecture="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4,
              num_kv_heads=2, head_dim=16)


@pytest.mark.parametrize("extra", [{}, {"tie_word_embeddings": True}, {"architecture": "qwen2", "qkv_bias": True},
                                   {"o_bias": True, "mlp_bias": True}, {"architecture": "qwen3", "qk_norm": True}])
def test_num_params_counts_every_weight(extra):
    """num_params is the element count of the params pytree: two norms per layer, the final norm, the LM head
    unless tied, and every bias and q/k norm the config enables (it left those out: 127424 for the Qwen2 and Qwen3
    configs here, whose params hold 127808 and 127520)."""
    cfg = ModelConfig(**{**_LLAMA, **extra})
    params = random_params(cfg, jax.random.key(0), jnp.float32)
    assert cfg.num_params() == sum(x.size for x in jax.tree_util.tree_leaves(params))
    assert cfg.num_params() == {(): 127424, ("tie_word_embeddings",): 127424 - 128 * 64,
                                ("architecture", "qkv_bias"): 127808, ("architecture", "qk_norm"): 127520,
                                ("mlp_bias", "o_bias"): 127424 + 3 * (64 + 2 * 128 + 64)}[tuple(sorted(extra))]


def test_heads_must_group_and_rms_norm_eps_must_be_positive():
    with pytest.raises(ConfigError, match="num_heads=6 is not a multiple of num_kv_heads=4"):
        ModelConfig(**{**_LLAMA, "num_heads": 6, "num_kv_heads": 4})
    with pytest.raises(ConfigError, match="rms_norm_eps=0.0: expected a positive finite number"):
        ModelConfig(**_LLAMA, rms_norm_eps=0.0)


def test_llama3_rope_wavelengths_exactly_on_the_band_edges_match_transformers():
    """llama3 RoPE's medium band is closed at both ends (transformers: ~(wavelen < high) & ~(wavelen > low)), and a
    wavelength exactly at low_wavelen is scaled once (inv_freq / factor, smooth = 0), not twice and not left
    unscaled. The factors are chosen so that one wavelength lies exactly on each edge (in f32, as both compute)."""
    D, theta, orig = 32, 10000.0, 64
    inv = 1.0 / (theta ** (np.arange(0, D, 2, dtype=np.float32) / D))
    wavelen = 2 * math.pi / inv  # f32
    low, high = orig / float(wavelen[6]), orig / float(wavelen[2])
    assert np.float32(orig / low) == wavelen[6] and np.float32(orig / high) == wavelen[2]  # exactly on the edges
    d = dict(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096, rope_theta=theta,
             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": low, "high_freq_factor": high,
                           "original_max_position_embeddings": orig})
    cfg = ModelConfig.from_hf(d)
    assert cfg.head_dim == D
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](transformers.LlamaConfig(**{k: v for k, v in d.items()
                                                                         if k != "model_type"}), "cpu")
    got = llama.rope_inv_freq(cfg)
    np.testing.assert_allclose(got[[2, 6]], [inv[2], inv[6] / 8.0], rtol=1e-6)  # the definition at the edges
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6)
