"""TokenButler's importance predictor: the Flax module and its configuration (inference side).

From the frozen model's layer-0 attention input `x` (the normed input of layer 0, `rms_norm(embed, attn_norm[0])`,
[B, T, E]), the predictor estimates every later layer's pre-softmax attention logits, per head:

    h  = down(x)                                   [B, T, E/8]      down-projection, no bias
    h  = h + attn(h)                               causal self-attention with RoPE, `attn_heads` heads
    h  = LayerNorm(h)
    y  = x + ffn_down(silu(ffn_up(h)))             [B, T, E]        feed-forward back up to E, residual
    q' = rope(q_out(silu(q_in(y))))                [B, T, L', Hq, d']    (L' = L - 1: layers 1..L-1)
    k' = rope(k_out(silu(k_in(y))))                [B, T, L', Hk', d']   (Hk' = Hq, or Hkv to share keys in a group)
    predicted logits of layer l, head h:  q'[l-1, h] . k'[l-1, h // (Hq / Hk')] / sqrt(d')

The module lives in `jsparse` (not `train/`) because the `butler` attention method runs it at inference, and the
library never imports its training code (tests/test_imports.py); `train/predictor.py` holds the size presets and the
training-side helpers.

Two entry points share every weight:
  * `Predictor.__call__(x, positions)`: the whole sequence at once, causal (training, prefill);
  * `Predictor.extend(x, positions, attn_k, attn_v)`: T new tokens attending over the predictor's own attention
    cache (decode); writes the new tokens' keys/values into the cache at `positions` and returns it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from models.llama import apply_rope

Array = jax.Array
F32 = jnp.float32


class PredictorConfigError(ValueError):
    """A predictor configuration that cannot be built (names the bad value and the valid range)."""


@dataclasses.dataclass(frozen=True)
class PredictorConfig:
    """Static shape of a predictor (hashable: a static argument of jitted functions).

    Attributes:
      hidden_size: E, the model's hidden size (the predictor's input and residual width).
      num_layers: L, the model's layers; the predictor predicts layers 1..L-1 (L' = L - 1 of them).
      num_heads: Hq, the model's query heads. num_kv_heads: Hkv, its KV heads.
      down_dim: width of the predictor's attention block (the paper: E / 8).
      attn_heads: heads of the predictor's own attention block; down_dim / attn_heads must be even (RoPE).
      ffn_dim: hidden width of the feed-forward that maps back up to E.
      qk_hidden: hidden width of the two QK networks (Linear -> SiLU -> Linear).
      head_dim: d', the predicted queries' and keys' width (even, for RoPE).
      key_heads: Hk', predicted key heads per layer: Hq (one key per query head, the paper) or Hkv (a GQA
        group shares one predicted key, a smaller key cache).
      rope_theta: RoPE base of the predictor's attention block and of q', k'.
      ln_eps: LayerNorm epsilon.
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    down_dim: int
    attn_heads: int
    ffn_dim: int
    qk_hidden: int
    head_dim: int
    key_heads: int
    rope_theta: float = 10000.0
    ln_eps: float = 1e-5

    def __post_init__(self):
        for name in ("hidden_size", "num_heads", "num_kv_heads", "down_dim", "attn_heads", "ffn_dim", "qk_hidden",
                     "head_dim", "key_heads"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise PredictorConfigError(f"{name}={value!r}: expected a positive integer")
        if not isinstance(self.num_layers, (int, np.integer)) or self.num_layers < 2:
            raise PredictorConfigError(f"num_layers={self.num_layers!r}: expected >= 2 (the predictor predicts "
                                       "layers 1..L-1)")
        if self.down_dim % self.attn_heads or (self.down_dim // self.attn_heads) % 2:
            raise PredictorConfigError(
                f"down_dim={self.down_dim}, attn_heads={self.attn_heads}: the attention head width down_dim / "
                "attn_heads must be an even integer (RoPE)")
        if self.head_dim % 2:
            raise PredictorConfigError(f"head_dim={self.head_dim}: expected an even d' (RoPE)")
        if self.key_heads not in (self.num_heads, self.num_kv_heads):
            raise PredictorConfigError(f"key_heads={self.key_heads}: expected num_heads={self.num_heads} or "
                                       f"num_kv_heads={self.num_kv_heads}")
        if self.num_heads % self.num_kv_heads:
            raise PredictorConfigError(f"num_heads={self.num_heads} is not a multiple of "
                                       f"num_kv_heads={self.num_kv_heads}")
        if not self.rope_theta > 0:
            raise PredictorConfigError(f"rope_theta={self.rope_theta}: expected > 0")

    @property
    def predicted_layers(self) -> int:
        """L' = L - 1: the layers 1..L-1 whose logits are predicted."""
        return self.num_layers - 1

    @property
    def attn_head_dim(self) -> int:
        return self.down_dim // self.attn_heads

    def num_params(self) -> int:
        """Parameter count (matches `count_params(init)`)."""
        E, dm, Lp = self.hidden_size, self.down_dim, self.predicted_layers
        down = E * dm
        attn = 4 * dm * dm
        norm = 2 * dm
        ffn = dm * self.ffn_dim + self.ffn_dim + self.ffn_dim * E + E
        qnet = E * self.qk_hidden + self.qk_hidden + self.qk_hidden * Lp * self.num_heads * self.head_dim \
            + Lp * self.num_heads * self.head_dim
        knet = E * self.qk_hidden + self.qk_hidden + self.qk_hidden * Lp * self.key_heads * self.head_dim \
            + Lp * self.key_heads * self.head_dim
        return down + attn + norm + ffn + qnet + knet

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "PredictorConfig":
        if not isinstance(d, Mapping):
            raise PredictorConfigError(f"predictor config {d!r}: expected an object of fields")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        names = set(fields)
        unknown = sorted(set(d) - names)
        if unknown:
            raise PredictorConfigError(f"unknown predictor config fields {unknown}; expected {sorted(names)}")
        missing = sorted(n for n, f in fields.items() if n not in d and f.default is dataclasses.MISSING
                         and f.default_factory is dataclasses.MISSING)
        if missing:
            raise PredictorConfigError(f"predictor config lacks {missing}; expected every field of {sorted(names)}")
        out = {}
        for k, v in d.items():
            if k in ("rope_theta", "ln_eps"):
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < float(v) < math.inf:
                    raise PredictorConfigError(f"predictor config {k}={v!r}: expected a positive number")
                out[k] = float(v)
            elif isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or float(v) != int(v):
                raise PredictorConfigError(f"predictor config {k}={v!r}: expected a whole number")
            else:
                out[k] = int(v)
        return cls(**out)

    def check_model(self, cfg) -> None:
        """Raises PredictorConfigError if the predictor was not made for a model of `cfg`'s shape."""
        want = dict(hidden_size=cfg.hidden_size, num_layers=cfg.num_layers, num_heads=cfg.num_heads,
                    num_kv_heads=cfg.num_kv_heads)
        got = {k: getattr(self, k) for k in want}
        if got != want:
            raise PredictorConfigError(f"the predictor was made for a model with {got}, but this model has {want}")


def _rope_inv_freq(dim: int, theta: float) -> np.ndarray:
    return (1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))).astype(np.float32)


# The most f32 scores `_attend_chunked` holds at once ([B, H, C, S] for a chunk of C queries): 256 MB.
ATTEND_CHUNK_SCORES = 1 << 26


def _attend_chunked(q: Array, k: Array, v: Array, q_pos: Array, k_pos: Array) -> Array:
    """`_attend` over chunks of queries (`lax.map`), so a long prefill over the predictor's cache never holds the
    [B, H, T, S] scores (32 GB at T = S = 32K for Llama-3.1-8B's predictor): at most ATTEND_CHUNK_SCORES of them."""
    B, T, H, _ = q.shape
    C = max(1, ATTEND_CHUNK_SCORES // (B * H * k.shape[1]))
    if C >= T:
        return _attend(q, k, v, q_pos, k_pos)
    n = -(-T // C)
    pad = n * C - T  # padded queries see every key (finite rows; sliced off below)
    qc = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(B, n, C, *q.shape[2:])
    pc = jnp.pad(q_pos, ((0, 0), (0, pad)), constant_values=jnp.iinfo(jnp.int32).max).reshape(B, n, C)
    out = jax.lax.map(lambda a: _attend(a[0], k, v, a[1], k_pos), (jnp.moveaxis(qc, 1, 0), jnp.moveaxis(pc, 1, 0)))
    return jnp.moveaxis(out, 0, 1).reshape(B, n * C, *out.shape[3:])[:, :T]


def _attend(q: Array, k: Array, v: Array, q_pos: Array, k_pos: Array, k_valid: Array | None = None) -> Array:
    """Causal softmax attention, f32.

    Args:
      q: f32[B, T, H, d]; k, v: f32[B, S, H, d]; q_pos: i32[B, T]; k_pos: i32[B, S] (key s is visible to query t
        iff k_pos[b, s] <= q_pos[b, t], and k_valid[b, s] when given).
    Returns:
      f32[B, T, H, d].
    """
    logits = jnp.einsum("bthd,bshd->bhts", q, k, precision=jax.lax.Precision.HIGHEST) / math.sqrt(q.shape[-1])
    visible = k_pos[:, None, :] <= q_pos[:, :, None]  # [B, T, S]
    if k_valid is not None:
        visible = visible & k_valid[:, None, :]
    logits = jnp.where(visible[:, None], logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("bhts,bshd->bthd", probs, v, precision=jax.lax.Precision.HIGHEST)


class Predictor(nn.Module):
    """TokenButler's predictor (see the module docstring). All computation in f32."""

    cfg: PredictorConfig

    def setup(self):
        c = self.cfg
        nh, hd = c.attn_heads, c.attn_head_dim
        dense = lambda n, name, bias=True: nn.Dense(n, use_bias=bias, name=name, param_dtype=F32)  # noqa: E731
        self.down = dense(c.down_dim, "down", bias=False)
        self.wq = nn.DenseGeneral((nh, hd), use_bias=False, name="wq", param_dtype=F32)
        self.wk = nn.DenseGeneral((nh, hd), use_bias=False, name="wk", param_dtype=F32)
        self.wv = nn.DenseGeneral((nh, hd), use_bias=False, name="wv", param_dtype=F32)
        self.wo = nn.DenseGeneral(c.down_dim, axis=(-2, -1), use_bias=False, name="wo", param_dtype=F32)
        self.norm = nn.LayerNorm(epsilon=c.ln_eps, name="norm", param_dtype=F32)
        self.ffn_up = dense(c.ffn_dim, "ffn_up")
        self.ffn_down = dense(c.hidden_size, "ffn_down")
        Lp = c.predicted_layers
        self.q_in = dense(c.qk_hidden, "q_in")
        self.q_out = dense(Lp * c.num_heads * c.head_dim, "q_out")
        self.k_in = dense(c.qk_hidden, "k_in")
        self.k_out = dense(Lp * c.key_heads * c.head_dim, "k_out")

    # -- pieces

    def _block_qkv(self, h: Array, positions: Array):
        inv = jnp.asarray(_rope_inv_freq(self.cfg.attn_head_dim, self.cfg.rope_theta))
        q = apply_rope(self.wq(h), positions, inv)
        k = apply_rope(self.wk(h), positions, inv)
        return q, k, self.wv(h)

    def _head(self, x: Array, h: Array, positions: Array):
        """Block output h: f32[B, T, dm] -> (q': f32[B, T, L', Hq, d'], k': f32[B, T, L', Hk', d'])."""
        c = self.cfg
        B, T = x.shape[:2]
        h = self.norm(h)
        y = x + self.ffn_down(nn.silu(self.ffn_up(h)))
        Lp = c.predicted_layers
        inv = jnp.asarray(_rope_inv_freq(c.head_dim, c.rope_theta))
        qp = self.q_out(nn.silu(self.q_in(y))).reshape(B, T, Lp * c.num_heads, c.head_dim)
        kp = self.k_out(nn.silu(self.k_in(y))).reshape(B, T, Lp * c.key_heads, c.head_dim)
        qp = apply_rope(qp, positions, inv).reshape(B, T, Lp, c.num_heads, c.head_dim)
        kp = apply_rope(kp, positions, inv).reshape(B, T, Lp, c.key_heads, c.head_dim)
        return qp, kp

    # -- entry points

    def __call__(self, x: Array, positions: Array):
        """The whole sequence, causal.

        Args:
          x: [B, T, E] the model's layer-0 attention input (any float dtype; computed in f32).
          positions: i32[B, T] token positions (0..T-1 for a prompt).
        Returns:
          (q': f32[B, T, L', Hq, d'], k': f32[B, T, L', Hk', d']), RoPE applied at `positions`.
        """
        x = x.astype(F32)
        h = self.down(x)
        q, k, v = self._block_qkv(h, positions)
        h = h + self.wo(_attend(q, k, v, positions, positions))
        return self._head(x, h, positions)

    def extend(self, x: Array, positions: Array, attn_k: Array, attn_v: Array):
        """T new tokens over the predictor's attention cache (decode).

        Args:
          x: [B, T, E] the new tokens' layer-0 attention input.
          positions: i32[B, T] their positions; each row's cache holds valid entries at every position below.
          attn_k, attn_v: f32[B, N, attn_heads, attn_head_dim] the predictor's attention cache (keys after RoPE).
        Returns:
          (q', k', attn_k, attn_v): as `__call__` for the new tokens, and the cache with them written at `positions`.
        """
        x = x.astype(F32)
        B, N = attn_k.shape[:2]
        h = self.down(x)
        q, k, v = self._block_qkv(h, positions)
        b = jnp.arange(B)[:, None]
        attn_k = attn_k.at[b, positions].set(k.astype(attn_k.dtype), mode="drop")
        attn_v = attn_v.at[b, positions].set(v.astype(attn_v.dtype), mode="drop")
        k_pos = jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32), (B, N))
        h = h + self.wo(_attend_chunked(q, attn_k.astype(F32), attn_v.astype(F32), positions, k_pos))
        qp, kp = self._head(x, h, positions)
        return qp, kp, attn_k, attn_v


def init_params(cfg: PredictorConfig, key: Array) -> dict:
    """Fresh predictor parameters (Flax default initialisers), a nested dict of f32 arrays."""
    return _init(cfg, key)


@functools.partial(jax.jit, static_argnums=0)
def _init(cfg: PredictorConfig, key: Array) -> dict:
    x = jnp.zeros((1, 2, cfg.hidden_size), F32)
    pos = jnp.zeros((1, 2), jnp.int32)
    return Predictor(cfg).init(key, x, pos)["params"]


def count_params(params) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(params)))


def flatten_params(params) -> dict[str, np.ndarray]:
    """Nested params -> {"down/kernel": array, ...} (the artifact's npz keys)."""
    flat = traverse_util.flatten_dict(jax.device_get(params), sep="/")
    return {k: np.asarray(v) for k, v in flat.items()}


def unflatten_params(flat: Mapping[str, np.ndarray], cfg: PredictorConfig, dtype=F32) -> dict:
    """{"down/kernel": ...} -> nested params, checked against `cfg`'s shapes (raises naming the bad tensor)."""
    want = traverse_util.flatten_dict(
        jax.eval_shape(lambda: init_params(cfg, jax.random.key(0))), sep="/")
    missing = sorted(set(want) - set(flat))
    extra = sorted(set(flat) - set(want))
    if missing or extra:
        raise PredictorConfigError(f"predictor parameters do not match the config: missing {missing}, "
                                   f"unexpected {extra}")
    out = {}
    for name, spec in want.items():
        arr = np.asarray(flat[name])
        if tuple(arr.shape) != tuple(spec.shape):
            raise PredictorConfigError(f"predictor tensor {name!r} has shape {tuple(arr.shape)}, but the config "
                                       f"implies {tuple(spec.shape)}")
        out[name] = jnp.asarray(arr.astype(np.float32), dtype)
    return traverse_util.unflatten_dict(out, sep="/")
