"""Perplexity on a text corpus, with decode simulated token by token or with the method's sparse prefill.

Windows: the corpus is tokenized once; each sample is the tokenizer's special prefix (BOS, if it adds one)
followed by `length - len(prefix)` consecutive corpus tokens from a seeded offset (non-overlapping windows
while the corpus holds enough of them).

Scored positions: every token 1..T-1 of a window is predicted from the tokens before it (T = length), so a
window contributes T - 1 negative log-likelihoods; perplexity = exp(mean NLL) pooled over all windows'
scored tokens.

Three variants:
  "decode"   `models.llama.decode` on an empty cache, fed the window in chunks of `chunk` tokens: every query
             row attends as a decode step would (its own per-row selection over the keys before it), which is
             what a method does when it generates token by token. The chunks only bound memory; the result
             does not depend on the chunk size for a method whose decode is per-row.
  "prefill"  `models.llama.prefill` over the whole window with all logits (the method's sparse prefill).
             Every token of the window is scored from this one forward, so a prefill method that computes no
             attention output for some query rows (Token Sparse Attention drops them) is scored on rows it
             never meant to produce.
  "continuation"
             how a user meets a prefill method (a prompt, then an answer): the method's prefill over the first
             P = T - C tokens of each window (C = `continuation` tokens, default 256), then the last C tokens
             teacher-forced through the method's decode (`models.llama.decode` on the prefill's cache, in chunks
             of `chunk` tokens, as in "decode"). Only the last C tokens are scored: token P from the prefill's
             last logit, tokens P+1..T-1 from the decode, so a window contributes C NLLs. For dense attention
             these equal the "decode" / "prefill" NLLs of the same positions.
"""

from __future__ import annotations

import functools
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from eval.passkey import special_prefix
from models import llama
from models.cache import KVCache, init_cache
from models.config import ModelConfig
from models.params import Params
from models.compile_options import model_jit

Array = jax.Array
VARIANTS = ("decode", "prefill", "continuation")
DEFAULT_VARIANTS = ("decode", "prefill")  # what `jsparse eval` runs unless --ppl-variants says otherwise
DEFAULT_CONTINUATION = 256
_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
# The evaluation corpus (ppl) and a separate development corpus (calibration), so that no method is scored on
# the text it was calibrated on (see eval/data/README.md).
DEFAULT_CORPUS = os.path.join(_DATA, "call_of_the_wild.txt")
DEV_CORPUS = os.path.join(_DATA, "alice_in_wonderland.txt")


def check_variants(variants) -> tuple[str, ...]:
    variants = tuple(variants)
    if not variants:
        raise ValueError(f"no perplexity variant given: expected some of {list(VARIANTS)}")
    for v in variants:
        if v not in VARIANTS:
            raise ValueError(f"unknown perplexity variant {v!r}: expected one of {list(VARIANTS)}")
    if len(set(variants)) != len(variants):  # one record per (method, budget, length, variant)
        raise ValueError(f"perplexity variants {list(variants)} name a variant twice: expected each once")
    return variants


def read_corpus(path: str | None) -> str:
    """Reads a UTF-8 text corpus; raises FileNotFoundError / ValueError naming the path when missing or empty."""
    if path is None:
        raise ValueError("the ppl task needs a corpus: pass --corpus PATH (a UTF-8 text file)")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"corpus {path!r} does not exist or is not a file: --corpus expects a UTF-8 "
                                "text file")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"corpus {path!r} is not UTF-8 text ({e}): --corpus expects a UTF-8 text file") from None
    if not text.strip():
        raise ValueError(f"corpus {path!r} is empty: --corpus expects a UTF-8 text file with some text")
    if (why := not_text(text)) is not None:
        raise ValueError(f"corpus {path!r} {why}: --corpus expects a UTF-8 text file")
    return text


def not_text(text: str) -> str | None:
    """Why decoded UTF-8 is not text, or None: a NUL character (a file of zeros, or other binary data that happens to
    decode, is refused rather than tokenized)."""
    i = text.find("\x00")
    return None if i < 0 else f"holds a NUL character (at character {i}): binary data, not text"


def tokenize_corpus(tokenizer, text: str) -> np.ndarray:
    """i32[N] corpus token ids (no special tokens): the text encoded whole, as the model meets it (verbose=False:
    no max-length warning for a long corpus).

    Until 2026-12-04 the text was encoded paragraph by paragraph, each with "\n\n" added back: every paragraph
    break became one token where the whole text has two on the bundled tokenizer, longer breaks shrank to one, and
    the ids did not decode to the text (call_of_the_wild.txt: 43,800 tokens instead of 44,125). Perplexities,
    corpus haystacks and calibrations measured before read those ids."""
    return np.asarray(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"], np.int32)


def check_windows(tokenizer, corpus_ids: np.ndarray, length: int, samples: int, flag: str = "--samples") -> int:
    """Checks that the corpus can give `samples` windows of `length` tokens; returns how many non-overlapping
    windows it holds (more samples than that overlap, with a warning from `make_windows`). `flag`: the option that
    gave `samples`, for the message.

    Raises:
      ValueError: samples < 1; a length too short for the special prefix; a corpus shorter than one window; or
        more samples than the corpus has distinct window offsets (windows would repeat), naming the numbers.
    """
    if samples < 1:
        raise ValueError(f"samples={samples}: expected >= 1")
    prefix = special_prefix(tokenizer)
    body = length - len(prefix)
    if body < 2:
        raise ValueError(f"ppl length={length}: expected at least {len(prefix) + 2} tokens")
    n = len(corpus_ids)
    if n < body:
        raise ValueError(f"the corpus has {n} tokens, fewer than the {body} needed for a window of length {length}; "
                         "use a longer corpus or a shorter length")
    offsets = n - body + 1
    if samples > offsets:
        raise ValueError(f"{flag} {samples}: the corpus ({n} tokens) has only {offsets} distinct windows of "
                         f"length {length} ({n // body} without overlap); use {flag} <= {n // body}, a longer "
                         "--corpus or a shorter length")
    return n // body


def make_windows(tokenizer, corpus_ids: np.ndarray, length: int, samples: int, seed: int) -> np.ndarray:
    """i32[samples, length] windows: special prefix + consecutive corpus tokens from seeded offsets.

    Windows do not overlap when the corpus holds `samples` of them; otherwise offsets are drawn freely (with a
    warning). Errors as `check_windows`.
    """
    slots = check_windows(tokenizer, corpus_ids, length, samples)
    prefix = np.asarray(special_prefix(tokenizer), np.int32)
    body = length - len(prefix)
    n = len(corpus_ids)
    rng = np.random.default_rng([seed, length])
    if samples <= slots:
        starts = np.sort(rng.choice(slots, size=samples, replace=False)) * body
        starts = starts + rng.integers(0, n - slots * body + 1)  # shift the grid; stays in range
    else:
        warnings.warn(f"ppl at length {length}: {samples} samples from a corpus holding {slots} non-overlapping "
                      "windows; the windows overlap")
        starts = rng.integers(0, n - body + 1, size=samples)
    rows = [np.concatenate([prefix, corpus_ids[s:s + body]]) for s in starts]
    return np.stack(rows).astype(np.int32)


def _token_nll(logits: Array, targets: Array) -> Array:
    """logits: f32[B, T, V], targets: i32[B, T] -> f32[B, T] negative log-likelihoods."""
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return lse - picked


@functools.partial(model_jit, static_argnames=("cfg",), donate_argnames=("cache",))
def decode_chunk_nll(params: Params, method, tokens: Array, targets: Array, cache: KVCache, state, *,
                     cfg: ModelConfig):
    """One chunk of simulated decoding.

    Args:
      tokens: i32[B, C] the next C tokens of each row (appended at cache.lengths).
      targets: i32[B, C] the token that follows each of them.
    Returns:
      (nll: f32[B, C], cache, state).
    """
    logits, cache, state = llama.decode(params, cfg, method, tokens, cache, state)
    return _token_nll(logits, targets), cache, state


def _capacity(T: int) -> int:
    return -(-T // 128) * 128


@functools.partial(model_jit, static_argnames=("cfg",))
def prefill_nll_state(params: Params, method, tokens: Array, *, cfg: ModelConfig):
    """tokens: i32[B, T] -> (f32[B, T - 1] NLL of tokens 1..T-1 under the method's prefill, the method's state
    after the prefill)."""
    B, T = tokens.shape
    cache = init_cache(cfg, B, T, params.embed.dtype)
    state = method.init_state(cfg, B, T)
    lengths = jnp.full((B,), T, jnp.int32)
    logits, _, state = llama.prefill(params, cfg, method, tokens, lengths, cache, state, all_logits=True)
    return _token_nll(logits[:, :-1], tokens[:, 1:]), state


def prefill_nll(params: Params, method, tokens: Array, *, cfg: ModelConfig) -> Array:
    """tokens: i32[B, T] -> f32[B, T - 1] NLL of tokens 1..T-1 under the method's prefill."""
    return prefill_nll_state(params, method, tokens, cfg=cfg)[0]


@functools.partial(model_jit, static_argnames=("cfg", "capacity"))
def prefill_last_nll(params: Params, method, tokens: Array, target: Array, *, cfg: ModelConfig, capacity: int):
    """The method's prefill of a prompt into a cache of `capacity` tokens, scoring the token after it.

    Args:
      tokens: i32[B, P] the prompts (all of length P); target: i32[B] the token that follows each.
    Returns:
      (nll: f32[B], cache, state) ready for `decode_chunk_nll` at position P.
    """
    B, P = tokens.shape
    cache = init_cache(cfg, B, capacity, params.embed.dtype)
    state = method.init_state(cfg, B, capacity)
    lengths = jnp.full((B,), P, jnp.int32)
    logits, cache, state = llama.prefill(params, cfg, method, tokens, lengths, cache, state)
    return _token_nll(logits[:, None], target[:, None])[:, 0], cache, state


@functools.partial(model_jit, static_argnames=("cfg", "continuation", "capacity", "return_state"))
def continuation_one_nll(params: Params, method, tokens: Array, *, cfg: ModelConfig, continuation: int,
                         capacity: int, return_state: bool = False):
    """The "continuation" variant in one compiled function (C = `continuation` tokens decoded in one call).

    Args:
      tokens: i32[B, T] windows; the method prefills tokens 0..P-1 (P = T - C) into a cache of `capacity` tokens,
        then decodes tokens P..T-1 in one `llama.decode` call of C queries.
    Returns:
      (nll: f32[B, C] of tokens P..T-1, the method's state right after the prefill, or None unless
       `return_state`).
    """
    B, T = tokens.shape
    P = T - continuation
    nll0, cache, state = prefill_last_nll.__wrapped__(params, method, tokens[:, :P], tokens[:, P], cfg=cfg,
                                                      capacity=capacity)
    targets = jnp.concatenate([tokens[:, P + 1:], jnp.zeros((B, 1), jnp.int32)], axis=1)
    logits, _, _ = llama.decode(params, cfg, method, tokens[:, P:], cache, state)
    nll = jnp.concatenate([nll0[:, None], _token_nll(logits, targets)[:, :continuation - 1]], axis=1)
    return nll, (state if return_state else None)


def decode_nll(params: Params, cfg: ModelConfig, method, tokens: np.ndarray, chunk: int = 512,
               on_chunk=None) -> np.ndarray:
    """tokens: i32[B, T] -> f32[B, T - 1] NLL of tokens 1..T-1, decoding the rows `chunk` tokens at a time.

    All T tokens are fed (the last one's prediction is dropped), so when `chunk` divides T every call has
    the same shapes and one (method, T) compiles once.
    """
    if chunk < 1:
        raise ValueError(f"chunk={chunk}: expected >= 1 tokens per decode call")
    B, T = tokens.shape
    capacity = _capacity(T)
    cache = init_cache(cfg, B, capacity, params.embed.dtype)
    state = method.init_state(cfg, B, capacity)
    inputs = jnp.asarray(tokens)
    targets = jnp.asarray(np.concatenate([tokens[:, 1:], np.zeros((B, 1), np.int32)], axis=1))
    out = []
    for s in range(0, T, chunk):
        nll, cache, state = decode_chunk_nll(params, method, inputs[:, s:s + chunk], targets[:, s:s + chunk],
                                             cache, state, cfg=cfg)
        out.append(np.asarray(nll))
        if on_chunk is not None:
            on_chunk()
    return np.concatenate(out, axis=1)[:, :-1]


def check_continuation(continuation: int, length: int) -> int:
    """C, the scored continuation tokens: an integer in [1, length - 2] (the prompt keeps at least 2 tokens)."""
    if isinstance(continuation, bool) or not isinstance(continuation, (int, np.integer)) \
            or not 1 <= continuation <= length - 2:
        raise ValueError(f"continuation={continuation!r} tokens with length {length}: expected an integer in "
                         f"[1, {length - 2}] (the prompt keeps at least 2 tokens)")
    return int(continuation)


def continuation_nll(params: Params, cfg: ModelConfig, method, tokens: np.ndarray, continuation: int,
                     chunk: int = 512, on_chunk=None, return_state: bool = False):
    """tokens: i32[B, T] -> f32[B, C] NLL of tokens T-C..T-1: the method's prefill of tokens 0..T-C-1, then its
    decode of the last C tokens, `chunk` tokens per call (see the module docstring, variant "continuation"); when
    C <= `chunk`, the prefill and the decode run as one compiled function (`continuation_one_nll`).

    With `return_state`, returns (nll, the method's state right after the prefill).
    """
    if chunk < 1:
        raise ValueError(f"chunk={chunk}: expected >= 1 tokens per decode call")
    tokens = np.asarray(tokens, np.int32)
    B, T = tokens.shape
    C = check_continuation(continuation, T)
    P = T - C
    if C <= chunk:  # one call: the prefill and the decode of all C tokens compile as one function
        nll, prefill_state = continuation_one_nll(params, method, jnp.asarray(tokens), cfg=cfg, continuation=C,
                                                  capacity=_capacity(T), return_state=return_state)
        if on_chunk is not None:
            on_chunk()
            on_chunk()
        nll = np.asarray(nll)
        return (nll, prefill_state) if return_state else nll
    nll0, cache, state = prefill_last_nll(params, method, jnp.asarray(tokens[:, :P]), jnp.asarray(tokens[:, P]),
                                          cfg=cfg, capacity=_capacity(T))
    prefill_state = state
    out = [np.asarray(nll0)[:, None]]
    if on_chunk is not None:
        on_chunk()
    # Feed tokens P..T-1 (the last prediction is dropped), targets P+1..T-1.
    inputs = jnp.asarray(tokens[:, P:])
    targets = jnp.asarray(np.concatenate([tokens[:, P + 1:], np.zeros((B, 1), np.int32)], axis=1))
    for s in range(0, C, chunk):
        nll, cache, state = decode_chunk_nll(params, method, inputs[:, s:s + chunk], targets[:, s:s + chunk],
                                             cache, state, cfg=cfg)
        out.append(np.asarray(nll))
        if on_chunk is not None:
            on_chunk()
    nll = np.concatenate(out, axis=1)[:, :C]
    return (nll, prefill_state) if return_state else nll


def perplexity(nll: np.ndarray) -> float:
    """exp(mean NLL) over all given token NLLs."""
    return float(np.exp(np.mean(np.asarray(nll, np.float64))))
