"""Logit and greedy-decoding parity with Hugging Face transformers on tiny random models of every family.

Each model is built here from a random init (norm weights and biases randomised too, so a dropped or transposed
norm/bias cannot hide behind ones and zeros), saved with `save_pretrained` (safetensors), loaded back with
`models.convert.load_hf_folder` in f32 and compared on a 544-token prompt: long enough that RoPE scaling and
position bugs show.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

transformers.utils.logging.disable_progress_bar()

from models.convert import from_transformers, load_hf_folder
from models.generate import check_request, generate_tokens
from jsparse.methods import make_method

PROMPT_LEN = 544
NEW_TOKENS = 32
VOCAB = 256

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
               initializer_range=0.1, rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None,
               pad_token_id=None)

FAMILIES = {
    "llama3_rope": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(
        sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen2_bias": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(use_sliding_window=False)),
    "qwen3_qknorm": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(
        head_dim=16, use_sliding_window=False)),
    "llama_tied": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        tie_word_embeddings=True, num_hidden_layers=2, attention_bias=True, mlp_bias=True)),
}


def build_model(family: str, seed: int = 0):
    """A tiny random f32 HF model of `family`, with randomised norm weights and biases."""
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = config_cls(**{**_COMMON, **extra})
    model = model_cls(config).eval().to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model


def prompt(seed: int = 1, length: int = PROMPT_LEN) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (1, length), generator=g).numpy()


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(tokens)).logits.float().numpy()


@pytest.fixture(scope="module", params=list(FAMILIES))
def saved(request, tmp_path_factory):
    family = request.param
    model = build_model(family)
    folder = tmp_path_factory.mktemp(family)
    model.save_pretrained(folder)
    return family, model, folder


def test_config_features(saved):
    family, model, folder = saved
    cfg, params = load_hf_folder(folder)
    expect = {"llama3_rope": ("llama", "rope", "llama3"), "mistral": ("mistral", None, None),
              "qwen2_bias": ("qwen2", "qkv_bias", True), "qwen3_qknorm": ("qwen3", "qk_norm", True),
              "llama_tied": ("llama", "tie_word_embeddings", True)}[family]
    assert cfg.architecture == expect[0]
    if family == "llama3_rope":
        assert cfg.rope.rope_type == "llama3" and cfg.rope.original_max_position == 64
    elif expect[1] is not None:
        assert getattr(cfg, expect[1]) is expect[2]
    if family == "llama_tied":
        assert params.lm_head is None and params.layers.bo is not None and params.layers.b_down is not None
    assert params.embed.dtype == jnp.float32


def test_logits_match_hf(saved, parity):
    family, model, folder = saved
    cfg, params = load_hf_folder(folder, dtype=jnp.float32)
    tokens = prompt()
    ref = hf_logits(model, tokens)
    ours = parity.logits(cfg, params, tokens)
    max_abs, kl = parity.compare(ours, ref)
    print(f"\nPARITY {family}: T={tokens.shape[1]} max_abs_diff={max_abs:.3e} KL={kl:.3e} "
          f"(|logits| max {np.abs(ref).max():.2f})")
    assert max_abs <= 1e-4, f"{family}: max abs logit diff {max_abs:.3e} > 1e-4 (KL {kl:.3e})"
    assert kl <= 1e-8, f"{family}: KL {kl:.3e}"
    # The comparison can fail: the logits are not flat, so a position or RoPE bug would show.
    assert np.abs(ref).max() > 1.0 and np.std(ref[0, -1]) > 0.1


def test_greedy_matches_hf_generate(saved):
    family, model, folder = saved
    cfg, params = load_hf_folder(folder, dtype=jnp.float32)
    tokens = prompt(seed=2)
    with torch.no_grad():
        # An explicit mask: otherwise generate() masks every prompt token equal to pad_token_id.
        hf_out = model.generate(torch.as_tensor(tokens), attention_mask=torch.ones(tokens.shape, dtype=torch.long),
                                max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    hf_new = hf_out[0, tokens.shape[1]:].numpy()
    assert hf_new.shape == (NEW_TOKENS,)
    capacity = check_request(cfg, [tokens.shape[1]], NEW_TOKENS)
    with jax.default_matmul_precision("highest"):
        out, num = generate_tokens(params, make_method("dense"), jnp.asarray(tokens, jnp.int32),
                                   jnp.asarray([tokens.shape[1]], jnp.int32), jax.random.key(0), cfg=cfg,
                                   max_new_tokens=NEW_TOKENS, capacity=capacity)
    ours = np.asarray(out[0])
    assert int(num[0]) == NEW_TOKENS
    np.testing.assert_array_equal(ours, hf_new, err_msg=f"{family}: greedy tokens differ from HF generate")
    assert len(set(hf_new.tolist())) > 1  # not a degenerate repeat that any bug would also produce


def _assert_params_equal(a, b):
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_sharded_checkpoint_and_from_transformers(tmp_path):
    model = build_model("qwen2_bias", seed=3)
    whole = tmp_path / "whole"
    sharded = tmp_path / "sharded"
    model.save_pretrained(whole)
    model.save_pretrained(sharded, max_shard_size="100KB")
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert (sharded / "model.safetensors.index.json").is_file() and len(shards) > 1, shards
    cfg_a, params_a = load_hf_folder(whole)
    cfg_b, params_b = load_hf_folder(sharded)
    cfg_c, params_c = from_transformers(model, jnp.float32)
    assert cfg_a == cfg_b == cfg_c
    _assert_params_equal(params_a, params_b)
    _assert_params_equal(params_a, params_c)


def test_bf16_checkpoint_loads(tmp_path):
    """bf16 safetensors (numpy has no bf16: read through the raw map) give the bf16 model's weights exactly."""
    model = build_model("llama3_rope", seed=4).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    cfg, params = load_hf_folder(tmp_path, dtype=jnp.float32)
    ref = model.model.layers[1].self_attn.q_proj.weight.detach().float().numpy()  # [Hq*D, E]
    wq = np.asarray(params.layers.wq[1])  # [E, Hq, D]
    np.testing.assert_array_equal(wq.reshape(cfg.hidden_size, -1).T, ref)
    cfg16, params16 = load_hf_folder(tmp_path, dtype=jnp.bfloat16)
    assert params16.layers.wq.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(params16.layers.wq[1], np.float32), wq)
