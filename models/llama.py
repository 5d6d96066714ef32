"""The Llama-family decoder as pure functions over a stacked-layer params pytree.

Both entry points run `jax.lax.scan` over layers (one scan per run of `method.segments`, one run by default). The
scan carry holds the layer counter, the hidden state, the KV cache and the attention method's selection state; each
layer reads its params, the method's per-layer info and its window at the counter (`_layer_reader`). Dtype policy:
weights and activations in the params' dtype (bf16 or f32), matmuls accumulate in f32, RMSNorm, RoPE, softmax and
logits in f32.

  prefill(params, cfg, method, tokens, lengths, cache, state) -> (logits, cache, state)
  decode(params, cfg, method, tokens, cache, state) -> (logits, cache, state)

Sliding-window layers (`cfg.layer_windows`) enter the scan as data: each layer's window (0 = full attention) is
read at the counter and handed to the method as `ctx.window`. The cache stays full length.

Both entry points check the request limits `models.generate.check_request` checks (batch sizes agree, the prompt
fits the cache, positions stay within the cache and the model's context) and the token ids (integers in
[0, vocab_size)): shapes and dtypes always, values when they are concrete (an eager call,
`models.generate.prefill_step` / `decode_step`). Under a trace the values cannot raise, so a result that would be
garbage (a prefill length outside the padded prompt, a decode write past the cache) gets NaN logits instead of wrong
numbers; traced token ids are not checked (the caller's: `models.generate.check_token_ids`).
"""

from __future__ import annotations

import math
import reprlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.attention import LayerContext, LayerKV, check_model, finish, segments, start
from models.cache import KVCache
from models.config import ModelConfig
from models.params import LayerParams, Params
from models.sharding import active_mesh, constrain
from pallas_kernels.kv_write import rope_write
from pallas_kernels.kv_write.reference import apply_rope, rms_norm, write_decode  # noqa: F401  (the model's pieces)

Array = jax.Array
F32 = jnp.float32
_CACHE_AXES = ("layers", "batch", "kv_heads", "length", "head_dim")


# ----------------------------------------------------------------------------------------------- pieces


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """f32[D/2] rotary inverse frequencies, with llama3 / linear scaling applied."""
    r, d = cfg.rope, cfg.head_dim
    inv_freq = 1.0 / (r.theta ** (np.arange(0, d, 2, dtype=np.float32) / d))
    if r.rope_type == "linear":
        inv_freq = inv_freq / r.factor
    elif r.rope_type == "llama3":
        low_wavelen = r.original_max_position / r.low_freq_factor
        high_wavelen = r.original_max_position / r.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / r.factor, inv_freq)
        smooth = (r.original_max_position / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
        smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = np.where(medium, smoothed, scaled)
    return inv_freq.astype(np.float32)


def _dense(x: Array, w: Array, spec: str, bias: Array | None = None) -> Array:
    # Output in the activation dtype: the matmul units accumulate in f32 either way, and a bf16 result avoids
    # writing (and re-reading) an f32 copy of every activation.
    y = jnp.einsum(spec, x, w, preferred_element_type=x.dtype)
    if bias is not None:
        y = (y.astype(F32) + bias.astype(F32)).astype(x.dtype)
    return y


def qkv_projection(cfg: ModelConfig, lp: LayerParams, h: Array, positions: Array, inv_freq: Array):
    """h: [B, T, E] (normed) -> q: [B, T, Hq, D], k, v: [B, T, Hkv, D], RoPE applied to q and k.

    Fused params (`models.params.fuse_projections`) run one GEMM for the three and slice its heads."""
    if lp.wqkv is not None:
        hq, hkv = lp.fused_heads
        qkv = _dense(h, lp.wqkv, "bte,ehd->bthd", lp.bqkv)
        q, k, v = qkv[:, :, :hq], qkv[:, :, hq:hq + hkv], qkv[:, :, hq + hkv:]
    else:
        q = _dense(h, lp.wq, "bte,ehd->bthd", lp.bq)
        k = _dense(h, lp.wk, "bte,ehd->bthd", lp.bk)
        v = _dense(h, lp.wv, "bte,ehd->bthd", lp.bv)
    if cfg.qk_norm:
        q = rms_norm(q, lp.q_norm, cfg.rms_norm_eps)
        k = rms_norm(k, lp.k_norm, cfg.rms_norm_eps)
    return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v


def mlp(cfg: ModelConfig, lp: LayerParams, x: Array) -> Array:
    h = rms_norm(x, lp.mlp_norm, cfg.rms_norm_eps)
    if lp.w_gate_up is not None:  # fused: one GEMM, gate then up
        gate_up = _dense(h, lp.w_gate_up, "bte,ef->btf", lp.b_gate_up)
        gate, up = jnp.split(gate_up, 2, axis=-1)
    else:
        gate = _dense(h, lp.w_gate, "bte,ef->btf", lp.b_gate)
        up = _dense(h, lp.w_up, "bte,ef->btf", lp.b_up)
    act = (jax.nn.silu(gate.astype(F32)) * up.astype(F32)).astype(x.dtype)
    return _dense(act, lp.w_down, "btf,fe->bte", lp.b_down)


def embed(params: Params, tokens: Array) -> Array:
    return jnp.take(params.embed, tokens, axis=0)


def lm_head_row_padding(rows: int, dtype) -> int:
    """Rows to add to the LM head's input: 7 for a single bf16 / f16 row on a GPU (to 8 rows), else 0.

    The LM head is the model's one GEMM with an f32 output from 16-bit inputs. With one row XLA runs it as a
    matrix-vector product in f32: it first converts the whole [E, V] weight to f32 (read 1 GB, write 2 GB at
    Llama-3.1-8B's vocabulary) and then reads that copy, 1.74 ms of a batch-1 decode step on an H100 against the
    0.35 ms the 8-row GEMM takes (eval/results/h100/profile_b1/). Two or more rows take the GEMM already (XLA pads
    them to 8 itself); other backends and dtypes are left alone."""
    return 7 if rows == 1 and _gpu_gemm_rows(dtype) else 0


def _gpu_gemm_rows(dtype) -> bool:
    """Whether a forward pads GEMM rows itself (`gemm_row_padding`, `lm_head_row_padding`): on a GPU, outside a mesh
    (where the batch rows are split), for bf16 / f16 activations."""
    return (jax.default_backend() == "gpu" and active_mesh() is None
            and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)))


def lm_logits(cfg: ModelConfig, params: Params, x: Array) -> Array:
    """x: [B, T, E] (last hidden state, before the final norm) -> f32[B, T, V]."""
    h = rms_norm(x, params.final_norm, cfg.rms_norm_eps)
    B, T = h.shape[:2]
    pad = lm_head_row_padding(B * T, h.dtype)
    if pad:  # one row as 8 (`lm_head_row_padding`): a GEMM instead of an f32 copy of the weight
        h = jnp.pad(h.reshape(1, 1, -1), [(0, 0), (0, pad), (0, 0)])
    if params.lm_head is None:
        logits = jnp.einsum("bte,ve->btv", h, params.embed, preferred_element_type=F32)
    else:
        logits = jnp.einsum("bte,ev->btv", h, params.lm_head, preferred_element_type=F32)
    return logits[:, :1].reshape(B, T, -1) if pad else logits


SMALL_LAYER_LEAF = 1 << 16  # elements per layer at most for a params leaf packed by `_layer_reader`


def _layer_reader(cfg: ModelConfig, params: Params, method):
    """(read(i) -> (layer params, info, window) of layer i) for the layer scans, i the loop counter (i32[]).

    Each leaf indexed by a loop counter is one slice per layer. A weight's slice is fused into its GEMM (XLA's
    dynamic-slice fusion); a small leaf's (a norm's weight, a bias) is a copy of its own on a GPU, one launch per
    leaf and layer. So the small float leaves (at most `SMALL_LAYER_LEAF` elements per layer; bf16, f16 or f32)
    are packed once per forward into one f32[L, n] array, read with one slice per layer and unpacked to their
    dtypes (exact: f32 holds each of those values); not under a mesh, where some are split by heads and packing
    them would gather and re-split them. The layer index is the counter itself, and the window a constant 0 when
    no layer is windowed."""
    layers = params.layers
    leaves, treedef = jax.tree_util.tree_flatten(layers)
    small = [j for j, a in enumerate(leaves) if a.size // a.shape[0] <= SMALL_LAYER_LEAF
             and jnp.dtype(a.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(F32))]
    if len(small) < 2 or active_mesh() is not None:  # under a mesh the leaves are split in different ways
        small = []
    L = cfg.num_layers
    packed = jnp.concatenate([leaves[j].reshape(L, -1).astype(F32) for j in small], axis=1) if small else None
    info, windows = method.layer_info(cfg), cfg.windows

    def read(i):
        at = lambda t: jax.lax.dynamic_index_in_dim(t, i, keepdims=False, allow_negative_indices=False)  # noqa: E731
        out = [None if j in small else at(a) for j, a in enumerate(leaves)]
        if small:
            row, start = at(packed), 0
            for j in small:
                a = leaves[j]
                n = a.size // L
                out[j] = row[start:start + n].reshape(a.shape[1:]).astype(a.dtype)
                start += n
        window = at(jnp.asarray(windows)) if windows.any() else jnp.int32(0)  # 0: no layer is windowed
        return jax.tree_util.tree_unflatten(treedef, out), jax.tree_util.tree_map(at, info), window

    return read


def binding_window(cfg: ModelConfig, method, kv_len: int) -> int | None:
    """The sliding window W when it can bind in a forward whose queries see up to `kv_len` keys, else None.

    Raises:
      ValueError: the window binds and `method` does not declare `supports_window`.
    """
    W = cfg.window_size
    if W is None or kv_len <= W:
        return None
    if not getattr(method, "supports_window", False):
        raise ValueError(
            f"attention method {type(method).__name__} does not support sliding-window attention, and this "
            f"{cfg.architecture} model's sliding_window={W} binds here ({kv_len} keys per query at most, > {W}); "
            "use a method that honours the window (jsparse.window_methods(): dense, quest) or keep prompt plus "
            f"generated tokens (and the cache capacity) within {W}")
    return W


# ----------------------------------------------------------------------------------------------- request checks


def _concrete(x) -> np.ndarray | None:
    """x as a numpy array, or None when it is traced (its values unknown until run)."""
    return None if isinstance(x, jax.core.Tracer) else np.asarray(x)


def _check_int_array(name: str, x, shape: str) -> None:
    """x an array (numpy, jax or traced) of an integer dtype (not bool); else ValueError naming `name` (`shape`: the
    expected one, for the message). Type and dtype only: the same under a trace."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise ValueError(f"{name} is a {type(x).__name__} ({reprlib.repr(x)}): expected an array {shape}")
    if not jnp.issubdtype(x.dtype, jnp.integer):  # (bool is not an integer dtype)
        raise ValueError(f"{name} of dtype {x.dtype}: expected an integer array {shape}")


def check_token_array(cfg: ModelConfig, tokens: Array) -> None:
    """tokens: an integer [B, T] array (dtype always; a float or bool array is refused by name) whose concrete ids
    lie in [0, cfg.vocab_size) (`jnp.take` would read a negative id from the end of the embedding and give NaN past
    it). Traced ids are not checked (their values are unknown until run)."""
    _check_int_array("tokens", tokens, "i32[B, T]")
    if tokens.ndim != 2:
        raise ValueError(f"tokens {tokens.shape}: expected i32[B, T]")
    got = _concrete(tokens)
    if got is not None and got.size:
        bad = (got < 0) | (got >= cfg.vocab_size)
        if bad.any():
            b, t = np.argwhere(bad)[0]
            raise ValueError(f"tokens has token id {int(got[b, t])} (row {b}, position {t}): expected ids in "
                             f"[0, {cfg.vocab_size}) (the model's vocabulary)")


def check_prefill_request(cfg: ModelConfig, tokens: Array, lengths: Array, cache: KVCache) -> Array | None:
    """Checks a prefill's limits; returns the rows whose logits would be garbage: bool[B] when `lengths` is traced,
    None when it is concrete (and passed).

    Shapes and dtypes always raise: tokens and lengths must be integer arrays (a list or a float array is refused
    by name, not converted). Concrete token ids must lie in [0, cfg.vocab_size) (`check_token_array`, padding
    included). Each row needs 1 <= lengths <= T (the padded prompt) and lengths <= cfg.max_position_embeddings:
    concrete lengths raise, traced ones flag the rows outside [1, T] (whose last-token logits would be read from the
    wrong position; past the context RoPE only extrapolates).
    """
    check_token_array(cfg, tokens)
    B, T = tokens.shape
    _check_int_array("lengths", lengths, f"i32[{B}]")
    if lengths.shape != (B,):
        raise ValueError(f"lengths {lengths.shape}: expected i32[{B}], one length per row of tokens {tokens.shape}")
    if cache.k.shape[1] != B or cache.lengths.shape != (B,):
        raise ValueError(f"cache batch {cache.k.shape[1]} (k {cache.k.shape}) and tokens batch {B} differ: "
                         "expected a cache made for this batch")
    if T > cache.capacity:
        raise ValueError(f"prompt of {T} tokens (padded) is longer than the KV cache capacity of {cache.capacity}")
    limit = min(T, cfg.max_position_embeddings)
    got = _concrete(lengths)
    if got is not None:
        bad = (got < 1) | (got > limit)
        if bad.any():
            raise ValueError(f"lengths {got.tolist()}: expected every row in [1, {limit}] (padded prompt length "
                             f"T={T}, model context max_position_embeddings={cfg.max_position_embeddings})")
        return None
    return (lengths < 1) | (lengths > T)


def check_decode_request(cfg: ModelConfig, tokens: Array, cache: KVCache) -> Array | None:
    """Checks a decode step's limits; returns the queries whose results would be garbage: bool[B, T] when the
    cache lengths are traced, None when they are concrete (and passed).

    tokens must be an integer [B, T] array with T >= 1 (always checked) whose concrete ids lie in
    [0, cfg.vocab_size) (`check_token_array`). Each row's T new tokens take positions cache.lengths ..
    cache.lengths + T - 1, which must lie within the cache capacity and the model's context; cache.lengths >= 0.
    Concrete lengths raise on any of these; traced ones flag the positions at or past the cache capacity (their
    writes are dropped).
    """
    check_token_array(cfg, tokens)
    B, T = tokens.shape
    if T < 1:
        raise ValueError(f"tokens {tokens.shape}: expected at least one new token per row (i32[B, T], T >= 1)")
    if cache.k.shape[1] != B or cache.lengths.shape != (B,):
        raise ValueError(f"cache batch {cache.k.shape[1]} (lengths {cache.lengths.shape}) and tokens batch {B} "
                         "differ: expected one cache row per row of tokens")
    limit = min(cache.capacity, cfg.max_position_embeddings)
    if T > limit:
        raise ValueError(f"{T} new tokens exceed the limit of {limit} tokens (cache capacity {cache.capacity}, "
                         f"max_position_embeddings={cfg.max_position_embeddings})")
    got = _concrete(cache.lengths)
    if got is not None:
        bad = (got < 0) | (got + T > limit)
        if bad.any():
            raise ValueError(f"cache lengths {got.tolist()} plus {T} new tokens: expected every row to end within "
                             f"{limit} tokens (cache capacity {cache.capacity}, "
                             f"max_position_embeddings={cfg.max_position_embeddings})")
        return None
    # Traced: flag the queries whose key/value write falls past the cache (dropped: their attention is garbage).
    # A position past max_position_embeddings only extrapolates RoPE; it is not flagged (a speculative round's
    # verification may reach past the context in rows that are then discarded).
    pos = cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None]  # [B, T]
    return (pos >= cache.capacity) | (cache.lengths < 0)[:, None]


def _write_prefill(cache_k: Array, layer: Array, k: Array) -> Array:
    """Writes k: [B, T, Hkv, D] into cache_k: [L, B, Hkv, N, D] at positions 0..T-1 of `layer`."""
    upd = jnp.swapaxes(k, 1, 2)[None].astype(cache_k.dtype)  # [1, B, Hkv, T, D]
    return jax.lax.dynamic_update_slice(cache_k, upd, (layer, 0, 0, 0, 0))


# ----------------------------------------------------------------------------------------------- forward


def gemm_row_padding(rows: int, dtype) -> int:
    """Rows to add so that a forward's B x T token rows reach a multiple of 8 for its GEMMs, or 0.

    On a GPU, XLA pads a bf16 / f16 GEMM's M dimension to a multiple of 8 for cuBLAS, one pad kernel for every
    GEMM input and a slice after (about 6 pads and 4 copies per layer for the 15 rows of a verification with
    gamma 4 at batch 3, or 4 rows of a batch-4 decode). `_scan_layers` instead pads the rows once per forward and
    runs every GEMM, norm and the MLP on them, slicing only q / k / v for the attention. One row (M = 1, a GEMV) is
    left alone, and so are other backends, other dtypes and forwards under a mesh (where the batch rows are split).
    """
    return -rows % 8 if rows > 1 and _gpu_gemm_rows(dtype) else 0


def layer_start(a: int) -> Array:
    """The layer index a run of the layer scan starts from (`_scan_layers`; a hook for probes of how XLA carries it,
    `eval/results/h100/layer_loop/`)."""
    return jnp.int32(a)


def layer_run(seg_fn, a: int, b: int, carry, unroll: int | bool = 1):
    """Layers a .. b - 1 of `_scan_layers` as one `lax.scan` of seg_fn ((i, carry), None) -> ((i + 1, carry), h)
    from layer_start(a): returns (carry, h stacked). A hook for probes of the loop's form
    (`eval/results/h100/layer_while/`)."""
    (_, carry), h = jax.lax.scan(seg_fn, (layer_start(a), carry), None, length=b - a, unroll=unroll)
    return carry, h


def _scan_layers(params: Params, cfg: ModelConfig, method, x: Array, positions: Array, lengths: Array,
                 cache: KVCache, state: Any, *, phase: str, kv_len: int, write, attend, collect: bool = False,
                 unroll: int | bool = 1):
    """The layer scan shared by prefill and decode.

    Each layer: RMSNorm, q/k/v with RoPE, `write(cache_k, layer, k)` into the stacked cache, `attend(ctx, q, k, v,
    cache_k, cache_v, state) -> (attn, state)` (the method), the output projection, the MLP. The carry holds
    (x, cache_k, cache_v, state); the method's `start`/`finish` bracket the scan.

    Returns:
      (x after the last layer, cache_k, cache_v, state, (inputs, after_attn) [L, B, T, E] each when `collect`).
    """
    B, T = positions.shape
    check_model(method, cfg)
    inv_freq = jnp.asarray(rope_inv_freq(cfg))
    window_size = binding_window(cfg, method, kv_len)
    pad = gemm_row_padding(B * T, x.dtype)
    if pad:  # the B x T rows as one row of B * T + pad tokens (`gemm_row_padding`); zeros in the padding
        rows = lambda a: jnp.pad(a.reshape((1, B * T) + a.shape[2:]), [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        unrows = lambda a: a[:, :B * T].reshape((B, T) + a.shape[2:])
    else:
        rows = unrows = lambda a: a
    rope_positions = rows(positions)

    def layer_fn(carry, xs, segment=None):
        x, ck, cv, state = carry
        lp, layer, info, window = xs
        h = rms_norm(x, lp.attn_norm, cfg.rms_norm_eps)
        if phase == "decode" and lp.wqkv is not None and active_mesh() is None:
            # The rotation and the cache write in one launch on a GPU (`pallas_kernels.kv_write`; a q/k norm as an
            # XLA fusion before it); the method's decode reads the cache, not k and v.
            qkv = _dense(h, lp.wqkv, "bte,ehd->bthd", lp.bqkv)
            q, ck, cv = rope_write(qkv.reshape((-1,) + qkv.shape[2:]), positions, inv_freq, ck, cv, layer,
                                   *lp.fused_heads, lp.q_norm, lp.k_norm, cfg.rms_norm_eps)
            k = v = None
        else:
            q, k, v = (unrows(a) for a in qkv_projection(cfg, lp, h, rope_positions, inv_freq))
            # Under a mesh (models.sharding): the method sees q, k, v and the cache split by heads and rows.
            q = constrain(q, ("batch", None, "heads", "head_dim"))
            k, v = (constrain(a, ("batch", None, "kv_heads", "head_dim")) for a in (k, v))
            ck, cv = (constrain(c, _CACHE_AXES) for c in (write(ck, layer, k), write(cv, layer, v)))
        h = unrows(h)
        ctx = LayerContext(layer=layer, lengths=lengths, info=info, hidden=h, segment=segment, window=window,
                           window_size=window_size, every_layer_windowed=cfg.every_layer_windowed,
                           kv_dtype=ck.dtype, rows_out=B * T + pad if pad else None)
        attn, state = attend(ctx, q, k, v, ck, cv, state)
        padded = pad and attn.shape[:2] == (1, B * T + pad)  # already in the GEMMs' rows (`ctx.rows_out`)
        x_attn = x + _dense(attn.astype(x.dtype) if padded else rows(attn.astype(x.dtype)), lp.wo, "bthd,hde->bte",
                            lp.bo)
        return (x_attn + mlp(cfg, lp, x_attn), ck, cv, state), ((unrows(x), unrows(x_attn)) if collect else None)

    state = start(method, cfg, state, phase, B, T, kv_len, lengths=lengths)
    read = _layer_reader(cfg, params, method)
    carry = (rows(x), constrain(cache.k, _CACHE_AXES), constrain(cache.v, _CACHE_AXES), state)
    # One scan per run of layers (`segments`; one run unless the method splits them). Each indexes the stacked
    # params with its loop counter (a slice of the params outside the loop would copy them; an index read from
    # an array would keep XLA from fusing the weight slice into the GEMMs, which then copies it every layer).
    parts = []
    for a, b, tag in segments(method, cfg, phase):
        def seg_fn(c, _, tag=tag):
            i, inner = c
            lp, info, window = read(i)
            inner, h = layer_fn(inner, (lp, i, info, window), segment=tag)
            return (i + 1, inner), h
        carry, h = layer_run(seg_fn, a, b, carry, unroll)
        parts.append(h)
    hidden = jax.tree_util.tree_map(lambda *hs: jnp.concatenate(hs), *parts) if collect else None
    x, ck, cv, state = carry
    return unrows(x), ck, cv, finish(method, state, phase), hidden


def prefill(params: Params, cfg: ModelConfig, method, tokens: Array, lengths: Array, cache: KVCache,
            state: Any, *, all_logits: bool = False, return_hidden: bool = False):
    """Runs the prompt through the model and fills the cache from position 0.

    Args:
      tokens: i32[B, T] right-padded prompts; lengths: i32[B] their lengths (1 <= lengths <= T).
      cache: an empty KVCache with capacity >= T; state: method.init_state(...).
      all_logits: return f32[B, T, V] (for perplexity) instead of f32[B, V] at each row's last token.
      return_hidden: also return (inputs, after_attn): each layer's residual input and its residual after the
        attention block (x + attn(x)), both [L, B, T, E] (for calibration).

    Returns:
      (logits, cache with lengths set, state) (+ (inputs, after_attn) when asked); a row whose length lies
      outside [1, T] under a trace gets NaN logits (see `check_prefill_request`).

    Raises:
      ValueError: tokens or lengths is not an integer array, batch sizes differ, T exceeds the cache capacity, a
        concrete token id lies outside [0, vocab_size), a concrete length lies outside
        [1, min(T, max_position_embeddings)], or the model's sliding window binds and `method` does not honour it.
    """
    bad = check_prefill_request(cfg, tokens, lengths, cache)
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))

    def attend(ctx, q, k, v, ck, cv, state):
        return method.prefill(ctx, q, k, v, state)

    x, ck, cv, state, hidden = _scan_layers(
        params, cfg, method, embed(params, tokens), positions, lengths, cache, state, phase="prefill",
        kv_len=T, write=_write_prefill, attend=attend, collect=return_hidden)
    # A copy, not the caller's array (astype of an int32 array is the array itself outside jit): the decode steps
    # donate the cache, which would delete the caller's lengths, and two caches prefilled from one array (the
    # speculative target and draft) would hand the same buffer in twice.
    cache = KVCache(k=ck, v=cv, lengths=jnp.array(lengths, jnp.int32, copy=True))
    if not all_logits:
        x = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)  # [B, 1, E]
        logits = lm_logits(cfg, params, x)[:, 0]
    else:
        logits = lm_logits(cfg, params, x)
    logits = _poison(logits, bad)
    if return_hidden:
        return logits, cache, state, hidden
    return logits, cache, state


def decode(params: Params, cfg: ModelConfig, method, tokens: Array, cache: KVCache, state: Any, *,
           unroll: int | bool = 1):
    """Appends tokens: i32[B, T] (T >= 1) at each row's cache length and returns f32[B, T, V] logits.

    Returns (logits, cache, state); under a trace, a query whose write falls past the cache capacity gets NaN
    logits (see `check_decode_request`).

    Raises:
      ValueError: tokens is not an integer array or T = 0, batch sizes differ, a concrete token id lies outside
        [0, vocab_size), (concrete lengths) a row's new tokens would pass the cache capacity or
        max_position_embeddings, or the model's sliding window binds and `method` does not honour it.
    """
    bad = check_decode_request(cfg, tokens, cache)
    T = tokens.shape[1]
    positions = cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
    lengths = cache.lengths + T

    def attend(ctx, q, k, v, ck, cv, state):
        layer = ctx.layer
        return method.decode(ctx, q, LayerKV(k=ck[layer], v=cv[layer], k_all=ck, v_all=cv, layer=layer), state)

    x, ck, cv, state, _ = _scan_layers(
        params, cfg, method, embed(params, tokens), positions, lengths, cache, state, phase="decode",
        kv_len=cache.capacity, write=lambda c, layer, k: write_decode(c, layer, positions, k), attend=attend,
        unroll=unroll)
    return _poison(lm_logits(cfg, params, x), bad), KVCache(k=ck, v=cv, lengths=lengths), state


def _poison(logits: Array, bad: Array) -> Array:
    """NaN logits (f32[B, ...]) where bad (bool[B] rows or bool[B, T] queries) is set; None (checked) is a no-op."""
    if bad is None:
        return logits
    return jnp.where(bad.reshape(bad.shape + (1,) * (logits.ndim - bad.ndim)), jnp.nan, logits)
