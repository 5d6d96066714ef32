"""Dense attention: the baseline every method is measured against (cuDNN prefill and an in-place split-K decode
kernel on GPU, XLA elsewhere)."""

from __future__ import annotations

from flax import struct

from jsparse.methods.base import register
from jsparse.methods.common import decode_dense, prefill_dense


@register("dense")
@struct.dataclass
class Dense:
    """Full causal attention (within the model's sliding window on windowed layers); its selection state is
    empty (None)."""

    supports_window = True  # honours ctx.window (models.attention)

    @classmethod
    def build(cls, **unused):
        return cls()

    def init_state(self, cfg, batch, max_len):
        return None

    def layer_info(self, cfg):
        return None

    def prefill(self, ctx, q, k, v, state):
        return prefill_dense(ctx, q, k, v), state

    def decode(self, ctx, q, cache, state):
        # Without a window: in place on a GPU (the stacked cache and the layer index; no copy of the layer's
        # cache per step). With one: a position mask in XLA.
        return decode_dense(ctx, q, cache), state
