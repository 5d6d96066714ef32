"""TSA sparse-layer selection from inter-layer representation drift (Jo et al., 2026).

On development prompts, with dense attention, for every layer l with residual input h_l and output h_{l+1}:

  R_l = mean over the valid tokens t of all prompts of ||h_{l+1,t} - h_{l,t}|| / (||h_{l,t}|| + eps)

(one mean over every token, so a longer prompt weighs more: a token-weighted mean, not a mean of per-prompt
means). Layers are ranked by ascending drift (rank 1 = the layer that changes its input the least); the
normalised rank is rank / L, and the layers with normalised rank <= delta (default 0.5, so half of the layers) are
sparse: a layer that barely moves the representation tolerates a coarser attention. (The
official code's profiled Llama-3.1-8B set, layers 15-30, is the low-drift half; the last layer, whose drift is
the largest, stays dense.)

The layer inputs come from `models.llama.prefill(..., return_hidden=True)`; layer l's output is layer l + 1's
input, and the last layer's output is recomputed from its after-attention residual (x_attn + mlp(x_attn)).
The artifact (kind "tsa", keyed to the model) holds `sparse_layers` (i32, ascending), `drift` (f32[L]) and
`normalized_rank` (f32[L]).
"""

from __future__ import annotations

from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np

from jsparse import selection as sel
from jsparse.artifacts import Artifact
from jsparse.methods.base import register_calibration
from jsparse.methods.dense import Dense
from jsparse.methods.tsa import ARTIFACT_KIND
from models import llama
from models.cache import init_cache


def check_delta(delta) -> float:
    """delta (the fraction of layers made sparse, by drift rank) must lie in (0, 1]."""
    if not sel.is_real(delta) or not 0.0 < float(delta) <= 1.0:
        raise ValueError(f"delta={delta!r}: expected the normalised drift rank threshold in (0, 1]")
    return float(delta)


def layer_drift(params, cfg, tokens, lengths, *, eps: float = 1e-6):
    """f32[L] mean relative drift of every layer over the valid tokens of a batch.

    Args:
      tokens: i32[B, T] right-padded prompts; lengths: i32[B] valid tokens per row.
      eps: added to the input norm.
    """
    B, T = tokens.shape
    cache = init_cache(cfg, B, T, params.embed.dtype)
    _, _, _, (x_in, x_attn) = llama.prefill(params, cfg, Dense(), tokens, lengths, cache, None,
                                            return_hidden=True)
    last = jax.tree_util.tree_map(lambda a: a[-1], params.layers)
    x_out_last = x_attn[-1] + llama.mlp(cfg, last, x_attn[-1])
    h = jnp.concatenate([x_in, x_out_last[None]], axis=0).astype(jnp.float32)  # [L + 1, B, T, E]
    rel = jnp.linalg.norm(h[1:] - h[:-1], axis=-1) / (jnp.linalg.norm(h[:-1], axis=-1) + eps)  # [L, B, T]
    valid = (jnp.arange(T)[None, :] < lengths[:, None]).astype(jnp.float32)  # [B, T]
    return jnp.sum(rel * valid, axis=(1, 2)) / jnp.maximum(jnp.sum(valid), 1.0)


def normalized_rank(drift) -> np.ndarray:
    """f64[L]: rank / L with rank 1 for the smallest drift (ties: the lower layer first)."""
    drift = np.asarray(drift, np.float64)
    order = np.argsort(drift, kind="stable")
    rank = np.empty(len(drift), np.float64)
    rank[order] = np.arange(1, len(drift) + 1)
    return rank / len(drift)


def sparse_layers_from_drift(drift, delta: float = 0.5) -> list[int]:
    """The layers whose normalised drift rank is <= delta, ascending."""
    delta = check_delta(delta)
    return [int(l) for l in np.nonzero(normalized_rank(drift) <= delta + 1e-12)[0]]


def calibrate(params, cfg, prompts: Iterable, *, delta: float = 0.5, eps: float = 1e-6, fingerprint: str = "",
              model_name: str = "", progress=None) -> Artifact:
    """Drift-based sparse-layer selection on prompts (each i32[B, T], or (tokens, lengths) pairs).

    Returns:
      Artifact(kind="tsa") with arrays sparse_layers i32[n], drift f32[L], normalized_rank f32[L].

    Raises:
      ValueError: delta outside (0, 1], eps not positive, no prompts.
    """
    delta = check_delta(delta)
    if not eps > 0:
        raise ValueError(f"eps={eps!r}: expected a positive number")
    drift_fn = jax.jit(layer_drift, static_argnames=("cfg", "eps"))
    total, weight, n = 0.0, 0.0, 0
    for item in prompts:
        tokens, lengths = item if isinstance(item, tuple) else (item, None)
        tokens = jnp.asarray(tokens, jnp.int32)
        if lengths is None:
            lengths = jnp.full((tokens.shape[0],), tokens.shape[1], jnp.int32)
        ln = np.asarray(lengths)
        if ln.shape != (tokens.shape[0],) or not np.issubdtype(ln.dtype, np.integer) or \
                np.any(ln < 1) or np.any(ln > tokens.shape[1]):
            raise ValueError(f"lengths={ln.tolist()}: expected one integer in [1, T={tokens.shape[1]}] per prompt row "
                             f"({tokens.shape[0]} rows; inside the jitted drift a bad length is not checked)")
        # Weighted by the batch's valid tokens (the drift is a token mean): prompts count alike however batched.
        tokens_in = float(np.sum(ln))
        total = total + tokens_in * np.asarray(drift_fn(params, cfg, tokens, jnp.asarray(lengths, jnp.int32), eps=eps),
                                               np.float64)
        weight += tokens_in
        n += int(tokens.shape[0])
        if progress is not None:
            progress(1)
    if n == 0:
        raise ValueError("no calibration prompts given")
    drift = total / weight
    layers = sparse_layers_from_drift(drift, delta)
    if not layers:
        raise ValueError(f"delta={delta}: selects none of the {len(drift)} layers (the layers whose normalised drift "
                         f"rank is <= delta); expected delta >= 1/{len(drift)} = {1 / len(drift):.4f}")
    return Artifact(kind=ARTIFACT_KIND, fingerprint=fingerprint,
                    arrays={"sparse_layers": np.asarray(layers, np.int32), "drift": drift.astype(np.float32),
                            "normalized_rank": normalized_rank(drift).astype(np.float32)},
                    meta={"model": model_name, "delta": delta, "eps": eps, "sparse_layers": layers,
                          "drift": [float(d) for d in drift], "prompts": n})


def add_arguments(p) -> None:
    p.add_argument("--delta", type=float, default=0.5,
                   help="sparse layers: those whose normalised drift rank is <= delta, in (0, 1] (default 0.5)")


def check_cli(args) -> None:
    """The flags' checks that need no model (before it loads)."""
    if not 0.0 < args.delta <= 1.0:  # (NaN fails too)
        raise ValueError(f"--delta {args.delta:g}: expected the normalised drift rank threshold in (0, 1]")


def run_cli(model, windows, args, progress=None) -> Artifact:
    from jsparse.artifacts import fingerprint

    L = model.cfg.num_layers
    if not sparse_layers_from_drift(np.zeros(L), args.delta):  # rank / L <= delta: none below 1 / L
        raise ValueError(f"--delta {args.delta:g}: selects none of the model's {L} layers (those whose normalised "
                         f"drift rank, rank / {L}, is <= delta); expected --delta >= 1/{L} = {1 / L:.4f}")
    return calibrate(model.params, model.cfg, (w[None] for w in windows), delta=check_delta(args.delta),
                     fingerprint=fingerprint(model), model_name=model.name, progress=progress)


register_calibration(ARTIFACT_KIND, add_arguments, run_cli, check=check_cli,
                     help="TSA: sparse layers from inter-layer representation drift (rank <= delta)")
