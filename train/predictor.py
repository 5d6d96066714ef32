"""TokenButler's predictor for training: size presets per model family, initialisation, parameter counts.

The module itself (`Predictor`, `PredictorConfig`) is defined in `jsparse.methods.butler_predictor` because the
`butler` attention method runs it at inference and the library never imports its training code; it is
re-exported here.

Sizing. The paper's predictor is about 1% of the model, with d' = 16-32 and QK networks 512-1280 wide on 7-8B
models. Almost all of its parameters sit in the QK networks' output layers (qk_hidden x L' * H * d'), so the
presets fix d' and pick `qk_hidden` to land near 1%:

  preset          model              E     L   Hq/Hkv  d'  qk_hidden  down/heads/ffn   predictor   of model
  smollm2-135m    SmolLM2-135M       576   30  9/3     16  128        72/2/144         1.38 M      1.03 %
  llama3-8b       Llama-3.1-8B       4096  32  32/8    32  1024       512/8/1024       81.4 M      1.01 %
  qwen3-8b        Qwen3-8B           4096  36  32/8    32  1024       512/8/1024       89.7 M      1.10 %

Other models get `auto_config`: the same rule (down = E / 8, d' = 16 up to E = 2048 else 32, ffn = 2 * down,
qk_hidden the multiple of 64 closest to the 1% target, at least 64).
"""

from __future__ import annotations

import math

import jax

from jsparse.methods.butler_predictor import (Predictor, PredictorConfig, PredictorConfigError,  # noqa: F401
                                              count_params, flatten_params, init_params, unflatten_params)
from models.config import ModelConfig

TARGET_FRACTION = 0.01

# name -> (model shape it is for: hidden, layers, heads, kv heads), predictor sizes.
PRESETS = {
    "smollm2-135m": ((576, 30, 9, 3), dict(down_dim=72, attn_heads=2, ffn_dim=144, qk_hidden=128, head_dim=16)),
    "llama3-8b": ((4096, 32, 32, 8), dict(down_dim=512, attn_heads=8, ffn_dim=1024, qk_hidden=1024, head_dim=32)),
    "qwen3-8b": ((4096, 36, 32, 8), dict(down_dim=512, attn_heads=8, ffn_dim=1024, qk_hidden=1024, head_dim=32)),
}


def _shape(cfg: ModelConfig) -> tuple[int, int, int, int]:
    return (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads)


def _build(cfg: ModelConfig, key_heads: str, **sizes) -> PredictorConfig:
    if key_heads not in ("query", "kv"):
        raise PredictorConfigError(f"key_heads={key_heads!r}: expected 'query' (one predicted key per query head) "
                                   "or 'kv' (one per KV head)")
    return PredictorConfig(hidden_size=cfg.hidden_size, num_layers=cfg.num_layers, num_heads=cfg.num_heads,
                           num_kv_heads=cfg.num_kv_heads,
                           key_heads=cfg.num_heads if key_heads == "query" else cfg.num_kv_heads, **sizes)


def _attn_heads(down_dim: int) -> int:
    """Heads of the predictor's block: width 32-64 per head when possible, and an even head width."""
    for heads in (max(1, down_dim // 64), max(1, down_dim // 36), max(1, down_dim // 32), 2, 1):
        if down_dim % heads == 0 and (down_dim // heads) % 2 == 0:
            return heads
    raise PredictorConfigError(f"down_dim={down_dim}: no head count gives an even head width")


def auto_config(cfg: ModelConfig, fraction: float = TARGET_FRACTION, key_heads: str = "query",
                head_dim: int | None = None) -> PredictorConfig:
    """A predictor of about `fraction` of the model's parameters (see the module docstring for the rule)."""
    if not 0.0 < fraction < 1.0:
        raise PredictorConfigError(f"fraction={fraction}: expected a fraction of the model in (0, 1)")
    down = max(2, (cfg.hidden_size // 8) // 2 * 2)
    dp = head_dim or (16 if cfg.hidden_size <= 2048 else 32)
    base = _build(cfg, key_heads, down_dim=down, attn_heads=_attn_heads(down), ffn_dim=2 * down, qk_hidden=1,
                  head_dim=dp)
    per_hidden = _build(cfg, key_heads, down_dim=down, attn_heads=_attn_heads(down), ffn_dim=2 * down,
                        qk_hidden=2, head_dim=dp).num_params() - base.num_params()
    target = fraction * cfg.num_params()
    hidden = max(64, int(round((target - base.num_params()) / per_hidden / 64.0)) * 64)
    return _build(cfg, key_heads, down_dim=down, attn_heads=_attn_heads(down), ffn_dim=2 * down, qk_hidden=hidden,
                  head_dim=dp)


def check_preset_name(preset: str | None) -> None:
    """PredictorConfigError unless `preset` is a key of PRESETS, "auto" or None (needs no model: the command checks
    it before loading one)."""
    if preset not in (None, "auto") and preset not in PRESETS:
        raise PredictorConfigError(f"unknown predictor preset {preset!r}; expected one of "
                                   f"{['auto', *sorted(PRESETS)]}")


def preset_config(cfg: ModelConfig, preset: str | None = None, key_heads: str = "query",
                  **overrides) -> PredictorConfig:
    """The predictor for `cfg`: a named preset, the preset matching the model's shape, or `auto_config`.

    Args:
      preset: a key of PRESETS, "auto", or None (the matching preset if any, else auto).
      key_heads: "query" (Hk' = Hq, the paper) or "kv" (Hk' = Hkv).
      overrides: PredictorConfig sizes to replace (down_dim, attn_heads, ffn_dim, qk_hidden, head_dim), None ignored.
    """
    overrides = {k: v for k, v in overrides.items() if v is not None}
    check_preset_name(preset)
    if preset is None:
        preset = next((name for name, (shape, _) in PRESETS.items() if shape == _shape(cfg)), "auto")
    if preset == "auto":
        sizes = {k: getattr(auto_config(cfg, key_heads=key_heads, head_dim=overrides.get("head_dim")), k)
                 for k in ("down_dim", "attn_heads", "ffn_dim", "qk_hidden", "head_dim")}
    else:
        shape, sizes = PRESETS[preset]
        if shape != _shape(cfg):
            raise PredictorConfigError(
                f"preset {preset!r} is for models of (hidden, layers, heads, kv heads) = {shape}, but this model "
                f"has {_shape(cfg)}; use --preset auto")
    return _build(cfg, key_heads, **{**sizes, **overrides})


def describe(pcfg: PredictorConfig, cfg: ModelConfig) -> dict:
    """Parameter counts of the predictor and the model, and their ratio."""
    n = pcfg.num_params()
    m = cfg.num_params()
    return {"predictor_params": n, "model_params": m, "fraction": n / m,
            "predictor_config": pcfg.to_dict()}


def checked_param_count(pcfg: PredictorConfig) -> int:
    """Parameters of an actual initialisation (shape-only, no allocation); equals pcfg.num_params()."""
    shapes = jax.eval_shape(lambda: init_params(pcfg, jax.random.key(0)))
    return int(sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(shapes)))
