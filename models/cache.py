"""The KV cache pytree: every layer's keys and values, head-major, with per-row lengths."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from models.config import ModelConfig

Array = jax.Array


@struct.dataclass
class KVCache:
    """k, v: [L, B, Hkv, N, D] (head-major: one KV head's tokens are contiguous, which XLA's decode einsum
    and the gathered kernels want); lengths: i32[B] tokens already written per row."""

    k: Array
    v: Array
    lengths: Array

    @property
    def capacity(self) -> int:
        return self.k.shape[3]


def init_cache(cfg: ModelConfig, batch: int, capacity: int, dtype=jnp.bfloat16) -> KVCache:
    """An empty cache with room for `capacity` tokens per row."""
    if capacity <= 0:
        raise ValueError(f"cache capacity={capacity}: expected a positive number of tokens")
    shape = (cfg.num_layers, batch, cfg.num_kv_heads, capacity, cfg.head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   lengths=jnp.zeros((batch,), jnp.int32))


def cache_axes() -> KVCache:
    """Logical axis names of the cache leaves."""
    axes = ("layers", "batch", "kv_heads", "length", "head_dim")
    return KVCache(k=axes, v=axes, lengths=("batch",))
