"""Speculative decoding: a draft model proposes gamma tokens, the target verifies gamma + 1 positions in one
decode call (T = gamma + 1 queries), and both KV caches roll back by their lengths alone.

State between rounds (`SpecState`): the target cache holds positions 0 .. n - 1 (`target.lengths` = n); `tok`
is the newest accepted token (position n, in neither cache yet) and `prev` the token at position n - 1. The
draft cache holds valid positions 0 .. n - 2 at least (rows past its lengths are garbage, never read).

One round (`spec_round`):
  1. the draft's lengths are set to n - 1 and it decodes [prev, tok] (T = 2; position n - 1 is rewritten with
     the same token), then gamma - 1 single tokens, proposing d_1 .. d_gamma from its distributions q_0 ..
     q_{gamma-1};
  2. the target decodes [tok, d_1, .., d_gamma] at positions n .. n + gamma in one call: p_0 .. p_gamma;
  3. acceptance: greedy (d_i accepted while d_i == argmax p_{i-1}) or speculative rejection sampling (d_i
     accepted with probability min(1, p_{i-1}(d_i) / q_{i-1}(d_i)); at the first rejection a the new token is
     drawn from norm(max(p_a - q_a, 0)), after gamma acceptances from p_gamma), so the emitted tokens are
     distributed exactly as the target's own samples. That holds when p_0 .. p_gamma depend on the accepted
     prefix alone: a target method that selects keys from the draft's attention over the whole round (STS, its
     proposals and the carry of earlier rounds included) makes p_i depend on the proposals, so an STS target's
     output (greedy too) depends on the draft and gamma;
  4. each row emits count = min(a + 1, its remaining budget, up to its first EOS) tokens and both caches'
     lengths become n + count (the rejected positions stay in the caches as garbage).

Re-feeding `prev` at the start of every round is what lets the draft's cache roll back by lengths alone: when
all gamma drafts are accepted, the draft never wrote d_gamma, and the next round writes it as its `prev`.

Attention methods (the `models.attention` protocol) run in both models. Two optional hooks serve methods whose
target selection comes from the draft's attention (STS):
  target_method.adopt_draft(target_state, draft_state) -> target_state   (after the draft's steps of a round,
      after its prefill and after an appended message, before the target's forward)
  method.end_prefill(cfg, state, batch, max_len) -> state   (after the prefill: the state the decode loop carries)
and two serve target methods whose state accumulates over decode steps (H2O's score, EvoSparse's heat), so that
it rolls back with the caches:
  target_method.begin_verify(state, rows) -> state   (before the verification of rows = gamma + 1 tokens: the
      state after each of them is kept)
  target_method.end_verify(state, count) -> state   (after the acceptance: the state after each batch row's first
      count[b] verification rows, as if only the tokens it emitted had been decoded)
The draft's own state is not rolled back (a draft method that accumulates sees its rejected tokens, and `prev`
twice); drafts run dense or record their attention for STS.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from models import llama
from models import sharding
from models.cache import KVCache, cache_axes, init_cache
from models.config import ModelConfig
from models.generate import Sampling, check_count, sample, scaled_logits, stop_ids
from models.params import Params
from models.compile_options import model_jit

Array = jax.Array


@struct.dataclass
class SpecState:
    """What crosses speculative rounds (and turns of a session).

    target, draft: the two KV caches (target.lengths = n: positions 0 .. n - 1 are valid).
    t_state, d_state: the target's and the draft's method states.
    tok: i32[B] the newest accepted token (position n, not in either cache); prev: i32[B] the token at n - 1.
    """

    target: KVCache
    draft: KVCache
    t_state: Any
    d_state: Any
    tok: Array
    prev: Array


def sampling_probs(logits: Array, sampling: Sampling) -> Array:
    """The distribution `models.generate.sample` draws from: f32[..., V] -> f32[..., V] (temperature > 0)."""
    logits = scaled_logits(logits, sampling.temperature)
    probs = jax.nn.softmax(logits, axis=-1)
    if sampling.nucleus:
        order = jnp.argsort(-logits, axis=-1)
        sorted_p = jnp.take_along_axis(probs, order, axis=-1)
        before = jnp.cumsum(sorted_p, axis=-1) - sorted_p  # mass strictly above each token
        keep_sorted = before < sampling.top_p
        keep = jnp.take_along_axis(keep_sorted, jnp.argsort(order, axis=-1), axis=-1)  # back to vocab order
        probs = jnp.where(keep, probs, 0.0)
        probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
    return probs


def _draw(key: Array, probs: Array) -> Array:
    """One token per row from f32[B, V] probabilities -> i32[B]."""
    return jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32)


def _adopt(t_method, t_state, d_state):
    fn = getattr(t_method, "adopt_draft", None)
    return t_state if fn is None else fn(t_state, d_state)


def _begin_verify(method, state, rows: int):
    fn = getattr(method, "begin_verify", None)
    return state if fn is None else fn(state, rows)


def _end_verify(method, state, count):
    fn = getattr(method, "end_verify", None)
    return state if fn is None else fn(state, count)


def _message_rows(method, state, rows):
    fn = getattr(method, "message_rows", None)
    return state if fn is None else fn(state, rows)


def _end_prefill(method, cfg, state, batch, max_len):
    fn = getattr(method, "end_prefill", None)
    return state if fn is None else fn(cfg, state, batch, max_len)


def check_gamma(gamma: int) -> int:
    return check_count("gamma", gamma, "draft tokens proposed per round")


def check_pair(t_cfg: ModelConfig, d_cfg: ModelConfig) -> None:
    """A draft must share the target's vocabulary."""
    if t_cfg.vocab_size != d_cfg.vocab_size:
        raise ValueError(f"draft vocabulary of {d_cfg.vocab_size} tokens differs from the target's "
                         f"{t_cfg.vocab_size}: a draft must share the target's tokenizer")


# ----------------------------------------------------------------------------------------------- pieces


def spec_prefill(t_params: Params, d_params: Params, t_method, d_method, tokens: Array, lengths: Array,
                 key: Array, *, t_cfg: ModelConfig, d_cfg: ModelConfig, capacity: int,
                 sampling: Sampling = Sampling()) -> SpecState:
    """Prefills both models (the draft first, so the target's method may adopt the draft's prefill state) and
    samples the first token from the target.

    Args:
      tokens: i32[B, T] right-padded prompts; lengths: i32[B] (>= 1).
    Returns:
      SpecState with tok = the first generated token per row, or -1 where the row's logits came back NaN (a
      length of 0 or past the prompt: the garbage `llama.prefill` marks so), which `spec_loop` ends with no token
      (as `generate.generate_tokens` ends it) instead of decoding argmax's token 0 and what follows.
    """
    B = tokens.shape[0]
    d_cache = sharding.constrain(init_cache(d_cfg, B, capacity, d_params.embed.dtype), cache_axes())
    t_cache = sharding.constrain(init_cache(t_cfg, B, capacity, t_params.embed.dtype), cache_axes())
    d_state = d_method.init_state(d_cfg, B, capacity)
    t_state = t_method.init_state(t_cfg, B, capacity)
    _, d_cache, d_state = llama.prefill(d_params, d_cfg, d_method, tokens, lengths, d_cache, d_state)
    t_state = _adopt(t_method, t_state, d_state)
    logits, t_cache, t_state = llama.prefill(t_params, t_cfg, t_method, tokens, lengths, t_cache, t_state)
    tok = jnp.where(jnp.any(jnp.isnan(logits), axis=-1), -1, sample(logits, key, sampling))
    prev = jnp.take_along_axis(tokens, (lengths - 1)[:, None], axis=1)[:, 0].astype(jnp.int32)
    return SpecState(target=t_cache, draft=d_cache,
                     t_state=_end_prefill(t_method, t_cfg, t_state, B, capacity),
                     d_state=_end_prefill(d_method, d_cfg, d_state, B, capacity), tok=tok, prev=prev)


def spec_append(t_params: Params, d_params: Params, t_method, d_method, s: SpecState, tokens: Array, key: Array,
                lengths: Array | None = None, *, t_cfg: ModelConfig, d_cfg: ModelConfig,
                sampling: Sampling = Sampling()) -> SpecState:
    """Appends a message to both caches (a new turn) without recomputing earlier ones and samples the first
    token of the reply.

    The pending token `s.tok` and the message tokens: i32[B, M] (M >= 1) are decoded at positions n .. n + M by the
    target, and with `prev` before them (from n - 1, as in a round) by the draft, the draft first (the target's
    method may adopt the draft's state). lengths: i32[B] (1 .. M, traced) each row's message tokens, the rest
    right padding (one compilation serves every message of a padded width): the padding rows are decoded as a
    round's rejected verification rows are (the target's `begin_verify` / `end_verify` keep the state of the rows
    kept; a recording draft's `message_rows` keeps them out of the record a target selects by) and both caches roll
    back past them by their lengths; None: all M.
    """
    n = s.target.lengths
    B, M = tokens.shape
    feed = jnp.concatenate([s.tok[:, None], tokens.astype(jnp.int32)], axis=1)  # [B, M + 1]
    m = None if lengths is None else jnp.clip(jnp.asarray(lengths, jnp.int32), 1, M)
    d_state = s.d_state if m is None else _message_rows(d_method, s.d_state, m + 2)  # [prev, tok] and the message
    _, d_cache, d_state = llama.decode(d_params, d_cfg, d_method, jnp.concatenate([s.prev[:, None], feed], axis=1),
                                       s.draft.replace(lengths=n - 1), d_state)
    if m is not None:
        d_state = _message_rows(d_method, d_state, None)
    t_state = _adopt(t_method, s.t_state, d_state)
    if m is None:
        logits, t_cache, t_state = llama.decode(t_params, t_cfg, t_method, feed, s.target, t_state)
        return SpecState(target=t_cache, draft=d_cache, t_state=t_state, d_state=d_state,
                         tok=sample(logits[:, -1], key, sampling), prev=feed[:, -1])
    t_state = _begin_verify(t_method, t_state, M + 1)
    logits, t_cache, t_state = llama.decode(t_params, t_cfg, t_method, feed, s.target, t_state)
    t_state = _end_verify(t_method, t_state, m + 1)  # the pending token and the message rows
    rows = jnp.arange(B)
    return SpecState(target=t_cache.replace(lengths=n + m + 1), draft=d_cache.replace(lengths=n + m + 1),
                     t_state=t_state, d_state=d_state, tok=sample(logits[rows, m], key, sampling),
                     prev=feed[rows, m])


def spec_round(t_params: Params, d_params: Params, t_method, d_method, s: SpecState, key: Array, limit: Array, *,
               t_cfg: ModelConfig, d_cfg: ModelConfig, gamma: int, sampling: Sampling = Sampling(),
               eos_ids: tuple[int, ...] = (), forced_accept: Array | None = None):
    """One speculative round (see the module docstring).

    Args:
      s: the state before the round; key: PRNG key (unused when greedy).
      limit: i32[B] most tokens each row may emit this round (0, or below, for a finished row: it emits nothing
        and its state stays as it was).
      forced_accept: i32[B] or None. For benchmarks only (random weights have no meaningful acceptance): the
        number of draft tokens accepted (0 .. gamma) instead of the acceptance test's; the work done is the same.
    Returns:
      (s, emitted: i32[B, gamma + 1] the row's new tokens then -1, count: i32[B] tokens emitted,
       accepted: i32[B] draft tokens the target accepted, 0 .. gamma).
    """
    check_gamma(gamma)
    B = s.tok.shape[0]
    n = s.target.lengths
    limit = jnp.maximum(limit, 0)  # a negative limit made count negative: both caches shrank under tok and prev
    greedy = sampling.greedy
    keys = jax.random.split(key, gamma + 2)

    def propose(logits_last, k):  # f32[B, V] -> (i32[B], f32[B, V] or None)
        if greedy:
            return jnp.argmax(logits_last, axis=-1).astype(jnp.int32), None
        q = sampling_probs(logits_last, sampling)
        return _draw(k, q), q

    # 1. The draft: [prev, tok] at n - 1, n, then gamma - 1 single tokens.
    d_cache = s.draft.replace(lengths=n - 1)
    logits, d_cache, d_state = llama.decode(d_params, d_cfg, d_method, jnp.stack([s.prev, s.tok], axis=1),
                                            d_cache, s.d_state)
    d1, q0 = propose(logits[:, -1], keys[0])

    def step(carry, k):
        tok, d_cache, d_state = carry
        logits, d_cache, d_state = llama.decode(d_params, d_cfg, d_method, tok[:, None], d_cache, d_state)
        nxt, q = propose(logits[:, -1], k)
        return (nxt, d_cache, d_state), (nxt, q)

    if gamma > 1:
        (_, d_cache, d_state), (rest, qs) = jax.lax.scan(step, (d1, d_cache, d_state), keys[1:gamma])
        drafts = jnp.concatenate([d1[:, None], rest.T], axis=1)  # [B, gamma]
        q = None if greedy else jnp.concatenate([q0[:, None], jnp.swapaxes(qs, 0, 1)], axis=1)  # [B, gamma, V]
    else:
        drafts = d1[:, None]
        q = None if greedy else q0[:, None]

    # 2. The target verifies gamma + 1 positions in one call.
    t_state = _begin_verify(t_method, _adopt(t_method, s.t_state, d_state), gamma + 1)
    verify = jnp.concatenate([s.tok[:, None], drafts], axis=1)  # [B, gamma + 1]
    logits, t_cache, t_state = llama.decode(t_params, t_cfg, t_method, verify, s.target, t_state)

    # 3. Acceptance.
    rows = jnp.arange(B)
    if greedy:
        choice = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, gamma + 1]
        accept = drafts == choice[:, :gamma]
        a = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)
        new = choice[rows, a]
    else:
        p = sampling_probs(logits, sampling)  # [B, gamma + 1, V]
        p_d = jnp.take_along_axis(p[:, :gamma], drafts[..., None], axis=-1)[..., 0]
        q_d = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
        u = jax.random.uniform(keys[gamma], (B, gamma))
        accept = u * q_d < p_d  # u < p / q, and q_d > 0 for a drawn token
        a = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)
        p_a = p[rows, a]
        q_a = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)[rows, a]  # q_gamma = 0: p_gamma itself
        resid = jnp.maximum(p_a - q_a, 0.0)
        total = jnp.sum(resid, axis=-1, keepdims=True)
        resid = jnp.where(total > 0, resid / jnp.where(total > 0, total, 1.0), p_a)  # p == q: nothing to fix
        new = _draw(keys[gamma + 1], resid)

    if forced_accept is not None:
        a = jnp.clip(forced_accept, 0, gamma).astype(a.dtype)
        new = jnp.argmax(logits[rows, a], axis=-1).astype(jnp.int32)

    # 4. What each row emits, and the rollback by lengths.
    j = jnp.arange(gamma + 1)[None]
    emitted = jnp.concatenate([drafts, drafts[:, :1]], axis=1)
    emitted = jnp.where(j == a[:, None], new[:, None], emitted)
    eos = stop_ids(eos_ids)
    is_eos = jnp.isin(emitted, eos) & (j <= a[:, None])
    first_eos = jnp.where(jnp.any(is_eos, axis=1), jnp.argmax(is_eos, axis=1), gamma + 1)
    count = jnp.minimum(jnp.minimum(a + 1, first_eos + 1), limit).astype(jnp.int32)
    emitted = jnp.where(j < count[:, None], emitted, -1)
    last = jnp.where(count >= 1, emitted[rows, jnp.maximum(count - 1, 0)], s.tok)
    prev = jnp.where(count >= 2, emitted[rows, jnp.maximum(count - 2, 0)], jnp.where(count == 1, s.tok, s.prev))
    new_len = n + count
    t_state = _end_verify(t_method, t_state, count)  # the state after the verification rows kept, 0 .. gamma + 1
    s = SpecState(target=t_cache.replace(lengths=new_len), draft=d_cache.replace(lengths=new_len),
                  t_state=t_state, d_state=d_state, tok=last, prev=prev)
    return s, emitted, count, jnp.where(limit > 0, a, 0).astype(jnp.int32)


def spec_loop(t_params: Params, d_params: Params, t_method, d_method, s: SpecState, key: Array, *,
              t_cfg: ModelConfig, d_cfg: ModelConfig, gamma: int, max_new_tokens: int,
              sampling: Sampling = Sampling(), eos_ids: tuple[int, ...] = (), row_new_tokens: Array | None = None):
    """Rounds until every row has max_new_tokens tokens or an EOS; `s.tok` is the first of them.

    row_new_tokens: i32[B] each row's own token count (1 .. max_new_tokens, traced: a value outside is taken as
    the nearer end; None: max_new_tokens for all): a row stops at it, so its rounds and accepted tokens count its
    own tokens only (rows of several tasks in one batch). A row whose `s.tok` is -1 (NaN prefill logits,
    `spec_prefill`) ends at once with no token.

    Returns:
      (out: i32[B, max_new_tokens] (-1 after a row's end), num: i32[B] tokens per row (EOS included),
       rounds: i32[B] rounds each row took part in, accepted: i32[B] draft tokens the target accepted over them,
       all of a round's, also those past the row's EOS or its last token, s).
    """
    B = s.tok.shape[0]
    width = max_new_tokens + gamma + 1
    eos = stop_ids(eos_ids)
    bad = s.tok < 0
    out = jnp.full((B, width), -1, jnp.int32).at[:, 0].set(s.tok)
    num = jnp.where(bad, 0, 1).astype(jnp.int32)
    stop = jnp.full((B,), max_new_tokens, jnp.int32) if row_new_tokens is None else \
        jnp.clip(jnp.asarray(row_new_tokens, jnp.int32), 1, max_new_tokens)
    done = bad | jnp.isin(s.tok, eos) | (num >= stop)
    zeros = jnp.zeros((B,), jnp.int32)

    def cond(c):
        return ~jnp.all(c[2])

    def body(c):
        s, out, done, num, rounds, accepted, key = c
        key, sub = jax.random.split(key)
        limit = jnp.where(done, 0, stop - num)
        s, emitted, count, acc = spec_round(t_params, d_params, t_method, d_method, s, sub, limit, t_cfg=t_cfg,
                                            d_cfg=d_cfg, gamma=gamma, sampling=sampling, eos_ids=eos_ids)
        cols = num[:, None] + jnp.arange(gamma + 1)[None]
        cols = jnp.where(emitted >= 0, cols, width)  # out of range: dropped
        out = out.at[jnp.arange(B)[:, None], cols].set(emitted, mode="drop")
        active = (limit > 0).astype(jnp.int32)
        num = num + count
        done = done | jnp.any(jnp.isin(emitted, eos), axis=1) | (num >= stop)
        return s, out, done, num, rounds + active, accepted + acc, key

    s, out, done, num, rounds, accepted, _ = jax.lax.while_loop(cond, body, (s, out, done, num, zeros, zeros, key))
    return out[:, :max_new_tokens], num, rounds, accepted, s


# ----------------------------------------------------------------------------------------------- jitted entry points


@functools.partial(model_jit, static_argnames=("t_cfg", "d_cfg", "gamma", "max_new_tokens", "capacity",
                                             "eos_ids"))
def speculative_generate(t_params: Params, d_params: Params, t_method, d_method, tokens: Array, lengths: Array,
                         key: Array, *, t_cfg: ModelConfig, d_cfg: ModelConfig, gamma: int, max_new_tokens: int,
                         capacity: int, sampling: Sampling = Sampling(), eos_ids: tuple[int, ...] = (),
                         row_new_tokens: Array | None = None):
    """Prefill of both models + speculative rounds, one jitted computation.

    Args:
      tokens: i32[B, T] right-padded prompts; lengths: i32[B]. capacity: cache rows per model; it must hold
        T + max_new_tokens + gamma + 1 (the verification writes past the accepted tokens), else ValueError.
      row_new_tokens: i32[B] or None, each row's own token count (see `spec_loop`).
    Returns:
      (out: i32[B, max_new_tokens], num: i32[B], rounds: i32[B], accepted: i32[B]) as `spec_loop`.
    """
    check_gamma(gamma)
    need = tokens.shape[1] + max_new_tokens + gamma + 1
    if need > capacity:  # a write past the cache would give NaN logits, which argmax reads as token 0
        raise ValueError(f"prompts of width {tokens.shape[1]} plus max_new_tokens={max_new_tokens} and gamma + 1 = "
                         f"{gamma + 1} verification rows is {need} tokens, more than the capacity={capacity} cache "
                         "rows (models.generate.check_request with verify_rows=gamma + 1 sizes it)")
    key, sub = jax.random.split(key)
    s = spec_prefill(t_params, d_params, t_method, d_method, tokens, lengths, sub, t_cfg=t_cfg, d_cfg=d_cfg,
                     capacity=capacity, sampling=sampling)
    out, num, rounds, accepted, _ = spec_loop(t_params, d_params, t_method, d_method, s, key, t_cfg=t_cfg,
                                              d_cfg=d_cfg, gamma=gamma, max_new_tokens=max_new_tokens,
                                              sampling=sampling, eos_ids=eos_ids, row_new_tokens=row_new_tokens)
    return out, num, rounds, accepted


def check_heads_on_mesh(t_cfg: ModelConfig, d_cfg: ModelConfig, mesh, what: str) -> None:
    """Raises ShardingError, prefixed by `what` and naming the model, when a head count of the target or the draft
    does not divide the mesh's model axis."""
    for who, cfg in (("target", t_cfg), ("draft", d_cfg)):
        try:
            sharding.check_heads(cfg, mesh)
        except sharding.ShardingError as e:
            raise sharding.ShardingError(f"{what}: the {who}'s {e}") from None


def sharded_speculative_generate(mesh, t_params: Params, d_params: Params, t_method, d_method, tokens: Array,
                                 lengths: Array, key: Array, *, t_cfg: ModelConfig, d_cfg: ModelConfig, gamma: int,
                                 max_new_tokens: int, capacity: int, sampling: Sampling = Sampling(),
                                 eos_ids: tuple[int, ...] = (), row_new_tokens: Array | None = None):
    """`speculative_generate` on `mesh`, the target and the draft on the same mesh: both models' params placed by
    heads (`models.sharding`; a no-op when already placed), the prompt rows over data, and the whole computation
    (both prefills, every round) one jitted call with the mesh set, so both caches shard by KV heads and rows and
    both models' kernels run per shard. STS's cross-head step (a target head reads the record of the draft head
    its head map names, held by any device) is XLA's gather over `model` (see `models.sharding`).

    Raises:
      ShardingError: a head count of either model does not divide the model axis (the message names which
        model), or the batch does not divide the data axis.
    Returns:
      what `speculative_generate` returns (rows over data).
    """
    check_heads_on_mesh(t_cfg, d_cfg, mesh, "speculative decoding on a mesh")
    sharding.check_batch(tokens.shape[0], mesh)
    t_params = jax.device_put(t_params, sharding.param_shardings(t_cfg, mesh, t_params))
    d_params = jax.device_put(d_params, sharding.param_shardings(d_cfg, mesh, d_params))
    tokens, lengths = sharding.shard_batch(tokens, mesh), sharding.shard_batch(lengths, mesh)
    if row_new_tokens is not None:
        row_new_tokens = sharding.shard_batch(jnp.asarray(row_new_tokens, jnp.int32), mesh)
    with sharding.use_mesh(mesh):
        return speculative_generate(t_params, d_params, t_method, d_method, tokens, lengths, key, t_cfg=t_cfg,
                                    d_cfg=d_cfg, gamma=gamma, max_new_tokens=max_new_tokens, capacity=capacity,
                                    sampling=sampling, eos_ids=eos_ids, row_new_tokens=row_new_tokens)


# The benchmark-ready round: one jitted call with both caches donated (call it repeatedly on its own output).
round_step = model_jit(spec_round, static_argnames=("t_cfg", "d_cfg", "gamma", "eos_ids"),
                     donate_argnames=("s",))
prefill_step = model_jit(spec_prefill, static_argnames=("t_cfg", "d_cfg", "capacity"))
append_step = model_jit(spec_append, static_argnames=("t_cfg", "d_cfg"), donate_argnames=("s",))
loop_step = model_jit(spec_loop, static_argnames=("t_cfg", "d_cfg", "gamma", "max_new_tokens", "eos_ids"),
                    donate_argnames=("s",))
