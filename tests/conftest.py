"""Shared fixtures: our logits for a converted model, and the logit comparison used by the parity tests."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest


def _our_logits(cfg, params, tokens, method_name: str = "dense") -> np.ndarray:
    """f32[B, T, V] logits of `models.llama.prefill(..., all_logits=True)` for tokens: int[B, T]."""
    from jsparse.methods import make_method
    from models import llama
    from models.cache import init_cache

    tokens = jnp.asarray(np.asarray(tokens), jnp.int32)
    B, T = tokens.shape
    method = make_method(method_name)
    cache = init_cache(cfg, B, T, params.embed.dtype)
    lengths = jnp.full((B,), T, jnp.int32)
    fn = jax.jit(lambda p, t, c: llama.prefill(p, cfg, method, t, lengths, c, method.init_state(cfg, B, T),
                                                all_logits=True)[0])
    with jax.default_matmul_precision("highest"):  # no TF32 for f32 matmuls when run on a GPU
        return np.asarray(fn(params, tokens, cache))


def _compare(ours: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """(max |ours - ref|, mean over positions of KL(softmax(ref) || softmax(ours))), both f32[..., V]."""
    ours = np.asarray(ours, np.float64)
    ref = np.asarray(ref, np.float64)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    logp = ref - np.logaddexp.reduce(ref, axis=-1, keepdims=True)
    logq = ours - np.logaddexp.reduce(ours, axis=-1, keepdims=True)
    kl = float(np.mean(np.sum(np.exp(logp) * (logp - logq), axis=-1)))
    return float(np.max(np.abs(ours - ref))), kl


@pytest.fixture(scope="session")
def parity():
    """`parity.logits(cfg, params, tokens)` and `parity.compare(ours, ref) -> (max_abs_diff, kl)`."""
    return types.SimpleNamespace(logits=_our_logits, compare=_compare)
