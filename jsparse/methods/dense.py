"""Dense attention: the baseline every method is measured against (cuDNN prefill and an in-place split-K decode
kernel on GPU, XLA elsewhere)."""

from __future__ import annotations

from flax import struct

from jsparse.methods.base import register
from jsparse.methods.common import attend_dense
from pallas_kernels.dense import dense_prefill


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
        # In place on a GPU (the stacked cache and the layer index; no copy of the layer's cache per step).
        return attend_dense(q, cache, ctx.lengths), state
