"""The attention seam between the model and the attention methods.

The model knows a method only by this protocol (it never imports `jsparse`). A method is a pytree
(`flax.struct.dataclass`): its configuration is static metadata (hashable) and its calibrated arrays (head
maps, layer roles, ...) are leaves, so the method object itself can be passed into a jitted function.

At every layer the model calls

  method.prefill(ctx, q, k, v, state) -> (out, state)
      q: [B, T, Hq, D] and k, v: [B, T, Hkv, D] (after RoPE); tokens are right-padded, ctx.lengths: i32[B]
      valid tokens per row; out: [B, T, Hq, D].
  method.decode(ctx, q, cache, state) -> (out, state)
      q: [B, T, Hq, D], the T newest tokens (T = 1 in plain decoding); cache: LayerKV with this layer's
      k, v: [B, Hkv, N, D] already holding the new tokens; ctx.lengths: i32[B] valid tokens after the write,
      so query t of row b sits at position lengths[b] - T + t.

and once per forward (outside the scan)

  method.init_state(cfg, batch, max_len) -> state pytree (carried through the layer scan and the decode loop)
  method.layer_info(cfg) -> pytree whose leaves have a leading axis of length L (the scan's `xs`), or None.
  method.start(cfg, state, phase, batch, q_len, kv_len) -> state   (optional; phase "prefill" or "decode";
      kv_len: keys a query may see at most, T in prefill and the cache capacity N in decode)
  method.start_rows(cfg, state, phase, lengths, q_len, kv_len) -> state   (optional; after `start`, with the
      rows' valid tokens after this forward's writes: work that depends on the query positions but not on the
      layer, done once per forward instead of in every layer)
  method.finish(state, phase) -> state                     (optional)
  method.check_model(cfg)    (optional) raises ValueError when the method was built for another model's shapes
      (`check_model` below runs it, with the generic checks, before every forward)

`start` and `finish` bracket one forward: a method whose layers hand data to later layers (Kascade's anchor
indices, EvoSparse's retrieval set) adds a buffer shaped for this forward's queries in `start` and drops it in
`finish`, so the state that crosses decode steps keeps one structure.

Sliding-window models (`cfg.layer_windows`): a method that honours the window declares `supports_window = True`
and reads `ctx.window` / `ctx.window_size`; the model refuses any other method when the window can bind (the keys
a query may see exceed the window), since its selection would reach keys the model must not see.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
from flax import struct

Array = jax.Array


@struct.dataclass
class LayerKV:
    """One layer's KV cache, head-major: k, v: [B, Hkv, N, D].

    Inside the model's layer scan the view also carries the whole stacked cache (`k_all`, `v_all`:
    [L, B, Hkv, N, D]) and the traced `layer` index. A kernel that takes the stacked cache and the layer index
    reads it in place; `k`/`v` are slices that XLA materialises (a copy of the layer's cache per step) only when
    a consumer that cannot fuse them (cuDNN, cuBLAS, a Pallas call) uses them, and drops when nothing does.
    """

    k: Array
    v: Array
    k_all: Array | None = None
    v_all: Array | None = None
    layer: Array | None = None


@struct.dataclass
class LayerContext:
    """What a method learns about the layer it runs in.

    Attributes:
      layer: i32[] index of the layer (traced inside the scan).
      lengths: i32[B] valid tokens per row (prompt length in prefill; cache length after the write in decode).
      info: this layer's slice of `method.layer_info(cfg)` (or None).
      hidden: [B, T, E] the layer's input hidden state after the attention norm (methods that predict
        importance from hidden states use it; most ignore it).
      segment: static tag of the run of layers this layer belongs to (`method.segments`), or None.
      window: i32[] this layer's sliding window in tokens (traced inside the scan; 0 = full attention): a query
        at position p sees keys p - window < j <= p.
      window_size: static W shared by the model's windowed layers when the window can bind in this forward (the
        keys a query may see, T in prefill or the cache capacity in decode, exceed W), else None: a method that
        sees None attends as if no layer were windowed.
      every_layer_windowed: static; with window_size set, True when every layer is windowed (no per-layer
        choice needed).
      kv_dtype: static dtype of the cache, which stores k and v rounded to it (None: not given). A method that
        keeps something computed from the prefill's k beside the cache rounds k as the cache does (on a GPU XLA
        may carry a bf16 value at higher precision into a fusion, `xla_allow_excess_precision`).
      rows_out: static R when the forward pads its B x T token rows to R for its GEMMs
        (`models.llama.gemm_row_padding`), else None. A method may then return its attention output in that form,
        [1, R, Hq, D] (token row b * T + t, zeros past B * T), which the model takes as is instead of padding
        [B, T, Hq, D] itself (one XLA kernel a layer on a GPU).
    """

    layer: Array
    lengths: Array
    info: Any = None
    hidden: Any = None
    segment: Any = struct.field(pytree_node=False, default=None)
    window: Any = None
    window_size: int | None = struct.field(pytree_node=False, default=None)
    every_layer_windowed: bool = struct.field(pytree_node=False, default=False)
    kv_dtype: Any = struct.field(pytree_node=False, default=None)
    rows_out: int | None = struct.field(pytree_node=False, default=None)


class AttentionMethod(Protocol):
    def init_state(self, cfg, batch: int, max_len: int) -> Any: ...

    def layer_info(self, cfg) -> Any: ...

    def prefill(self, ctx: LayerContext, q: Array, k: Array, v: Array, state: Any) -> tuple[Array, Any]: ...

    def decode(self, ctx: LayerContext, q: Array, cache: LayerKV, state: Any) -> tuple[Array, Any]: ...


def check_model(method, cfg) -> None:
    """Raises ValueError when `method` cannot run on the model of `cfg`: a method built (or calibrated) for another
    model, whose per-layer arrays (`layer_info`) count other layers, or whose own `check_model(cfg)` refuses the
    model's heads; or `dense_layers` beyond the model's layers (a budget that would never apply)."""
    import dataclasses

    import jax
    import numpy as np

    name = type(method).__name__
    L = cfg.num_layers
    dense = getattr(method, "dense_layers", None)
    fields = {f.name: f for f in dataclasses.fields(method)} if dataclasses.is_dataclass(method) else {}
    default = fields["dense_layers"].default if "dense_layers" in fields else None
    if isinstance(dense, (int, np.integer)) and not isinstance(dense, bool) and dense > L and dense != default:
        # A default beyond a small model's layers (Quest's 2 on a 1-layer model) means all of them, as before.
        raise ValueError(f"{name}: dense_layers={dense}: expected 0..{L} (the model's {L} layers)")
    inner = getattr(method, "inner", None)
    if inner is not None:  # first, and named as its own: the outer method's layer_info may combine the inner's
        check_model(inner, cfg)
    own_info = method.layer_info(cfg)
    if inner is not None and hasattr(own_info, "inner"):
        own_info = own_info.replace(inner=None)
    for leaf in jax.tree_util.tree_leaves(own_info):
        if getattr(leaf, "ndim", 0) == 0 or leaf.shape[0] != L:
            raise ValueError(f"{name} holds per-layer arrays of shape {tuple(getattr(leaf, 'shape', ()))}, but the "
                             f"model has {L} layers: it was built or calibrated for another model; build it for "
                             "this one (`jsparse.build_method(NAME, model, ...)`)")
    own = getattr(method, "check_model", None)
    if own is not None:
        own(cfg)


def start(method, cfg, state, phase: str, batch: int, q_len: int, kv_len: int, lengths=None):
    """Calls `method.start`, then `method.start_rows` (with `lengths`, when given), where the method defines them."""
    fn = getattr(method, "start", None)
    state = state if fn is None else fn(cfg, state, phase, batch, q_len, kv_len)
    rows = getattr(method, "start_rows", None)
    return state if rows is None or lengths is None else rows(cfg, state, phase, lengths, q_len, kv_len)


def finish(method, state, phase: str):
    fn = getattr(method, "finish", None)
    return state if fn is None else fn(state, phase)


def runs_of(tags) -> tuple[tuple[int, int, Any], ...]:
    """The runs of consecutive equal tags of layers 0..L-1, as `segments` takes them: ((start, stop, tag), ...)."""
    tags = list(tags)
    starts = [0] + [i for i in range(1, len(tags)) if tags[i] != tags[i - 1]]
    return tuple((a, b, tags[a]) for a, b in zip(starts, starts[1:] + [len(tags)]))


def segments(method, cfg, phase: str) -> tuple[tuple[int, int, Any], ...]:
    """The runs of layers the model scans separately: ((start, stop, tag), ...) covering 0..L in order.

    A method may define `segments(cfg, phase)` (returning such a tuple, or None for one run) when its layers
    fall into kinds known before tracing (e.g. EvoSparse's dense first layers in decode): each run is its own
    layer scan and its layers see `ctx.segment = tag`, so no layer pays for the other kind's work (neither a
    `lax.cond`, which waits for its predicate on the host on a GPU, nor both kinds' kernels and a select).
    """
    L = cfg.num_layers
    fn = getattr(method, "segments", None)
    segs = None if fn is None else fn(cfg, phase)
    if not segs:
        return ((0, L, None),)
    segs = tuple((int(a), int(b), t) for a, b, t in segs)
    bounds = [segs[0][0]] + [b for _, b, _ in segs]
    if bounds[0] != 0 or bounds[-1] != L or any(a != p for (a, _, _), p in zip(segs, bounds)) or \
            any(b <= a for a, b, _ in segs):
        raise ValueError(f"method segments {segs}: expected consecutive non-empty runs covering layers 0..{L}")
    return segs
