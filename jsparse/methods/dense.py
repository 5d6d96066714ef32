"""Dense attention: the baseline every method is measured against (cuDNN on GPU, XLA elsewhere)."""

from __future__ import annotations

from flax import struct

import jax
import jax.numpy as jnp

from jsparse.methods.base import register
from pallas_kernels.dense import dense_decode, dense_prefill
from pallas_kernels.dense_decode import dense_decode_stacked, supported


@register("dense")
@struct.dataclass
class Dense:
    """Full causal attention; its selection state is empty (None)."""

    @classmethod
    def build(cls, **unused):
        return cls()

    def init_state(self, cfg, batch, max_len):
        return None

    def layer_info(self, cfg):
        return None

    def prefill(self, ctx, q, k, v, state):
        return dense_prefill(q, k, v), state

    def decode(self, ctx, q, cache, state):
        # On a GPU with 16-bit activations (where dense_decode runs cuDNN), inside the model's layer scan, read
        # the layer of the stacked cache in place with a Pallas split-K kernel: handing cuDNN the slice cache.k
        # makes XLA copy the layer's whole cache every step. f32 keeps dense_decode's XLA path.
        if (getattr(cache, "layer", None) is not None and jax.default_backend() == "gpu"
                and q.dtype in (jnp.bfloat16, jnp.float16) and supported("pallas_gpu", q)):
            return dense_decode_stacked(q, cache.k_all, cache.v_all, cache.layer, ctx.lengths,
                                        implementation="pallas_gpu"), state
        return dense_decode(q, cache.k, cache.v, ctx.lengths), state
