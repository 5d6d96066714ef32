"""Configurations of real model shapes, for benchmarks on random weights (no checkpoint needed)."""

from __future__ import annotations

from models.config import ModelConfig, RopeConfig

PRESETS = {
    # Llama-3.1-8B: 32 layers, 32 query / 8 KV heads, d=128, llama3 RoPE scaling, 128K context.
    "llama3-8b": ModelConfig(
        architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
        rope=RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                        original_max_position=8192),
        max_position_embeddings=131072, bos_token_id=128000, eos_token_ids=(128001, 128008, 128009)),
    # Qwen3-8B: 36 layers, 32 query / 8 KV heads, d=128, q/k RMSNorm (context extended to 128K for benchmarks).
    "qwen3-8b": ModelConfig(
        architecture="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope=RopeConfig(theta=1000000.0),
        qk_norm=True, max_position_embeddings=131072, eos_token_ids=(151645,)),
}


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model shape {name!r}; expected one of {sorted(PRESETS)}")
    return PRESETS[name]
