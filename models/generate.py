"""Generation: a jitted prefill followed by an on-device decode loop (`lax.while_loop`), all one computation.

`generate_tokens` compiles once per (config, method structure, prompt bucket, capacity, bucket of max_new_tokens,
greedy or sampled, with or without top_p) and never retraces per token (nor per temperature or top_p value: they
are traced): the loop carries the KV cache, the method's selection state, the
last tokens, the per-row done flags and the PRNG key.
"""

from __future__ import annotations

import functools
import reprlib
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from models import llama
from models import sharding
from models.cache import KVCache, cache_axes, init_cache
from models.config import ModelConfig
from models.params import Params
from models.compile_options import model_jit

Array = jax.Array


_TINY = float(np.finfo(np.float32).tiny)
NEW_TOKENS_BUCKET = 64  # generate_tokens compiles its loop for max_new_tokens rounded up to a multiple of this


@struct.dataclass
class Sampling:
    """temperature == 0 is greedy; otherwise softmax(logits / temperature) restricted to the top-p nucleus.

    A pytree: temperature and top_p are traced leaves (a jitted loop compiles once for every temperature and
    top_p value), `greedy` (temperature 0) and `nucleus` (top_p < 1) static fields derived when it is made (the
    code paths they choose are compiled separately)."""

    temperature: float = 0.0
    top_p: float = 1.0
    greedy: bool = struct.field(pytree_node=False, default=None)
    nucleus: bool = struct.field(pytree_node=False, default=None)

    def __post_init__(self):
        if self.greedy is not None and not isinstance(self.temperature, (int, float, np.integer, np.floating)):
            return  # rebuilt by jax from traced leaves (checked when made)
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
                raise ValueError(f"{name}={value!r}: expected a number")
        if not 0 <= self.temperature < float("inf"):  # NaN fails too
            raise ValueError(f"temperature={self.temperature}: expected a finite value >= 0 (0 is greedy)")
        if 0 < self.temperature < _TINY:  # a subnormal is flushed to 0 on the device: logits / 0
            raise ValueError(f"temperature={self.temperature}: expected 0 (greedy) or at least {_TINY:.3g}, the "
                             "smallest normal float32")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p}: expected a value in (0, 1]")
        if self.top_p < _TINY:  # 0 or subnormal in float32 on the device: an empty nucleus (NaN probabilities)
            raise ValueError(f"top_p={self.top_p}: expected a value in (0, 1] of at least {_TINY:.3g}, the smallest "
                             "normal float32")
        for name, flag in (("greedy", self.temperature == 0.0), ("nucleus", self.top_p < 1.0)):
            if getattr(self, name) not in (None, flag):
                raise ValueError(f"{name}={getattr(self, name)!r}: it follows from temperature and top_p ({flag})")
            object.__setattr__(self, name, bool(flag))
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))


def scaled_logits(logits: Array, temperature: float) -> Array:
    """(logits - their row max) / temperature in f32: the same softmax as logits / temperature, but a tiny
    temperature sends the others to -inf instead of overflowing every logit to +-inf (NaN probabilities)."""
    logits = logits.astype(jnp.float32)
    return (logits - jnp.max(logits, axis=-1, keepdims=True)) / temperature


def sample(logits: Array, key: Array, sampling: Sampling) -> Array:
    """logits: f32[B, V] -> i32[B]."""
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = scaled_logits(logits, sampling.temperature)
    if sampling.nucleus:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each token
        sorted_logits = jnp.where(before < sampling.top_p, sorted_logits, -jnp.inf)
        choice = jax.random.categorical(key, sorted_logits, axis=-1)
        return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def stop_ids(eos_ids: tuple[int, ...]) -> Array:
    """i32[E]: the ids that end a row, for `jnp.isin`; with none, -2, which no sampled token equals (-1 marks a
    done row's slot)."""
    return jnp.asarray(eos_ids if eos_ids else (-2,), jnp.int32)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def check_capacity_fits(cfg: ModelConfig, capacity: int, verify_rows: int = 0) -> None:
    """ValueError naming `capacity` when it is past the rows any request can fill: the model's context and the
    `verify_rows` a speculative verification writes past it, rounded up to 128 (the rows past that would be
    allocated all the same: an out-of-memory error that names nothing)."""
    most = round_up(cfg.max_position_embeddings + verify_rows, 128)
    if capacity > most:
        raise ValueError(f"capacity={capacity}: more KV cache rows than the model's context of "
                         f"{cfg.max_position_embeddings} tokens can fill; expected at most {most}")


def check_request(cfg: ModelConfig, prompt_lengths: Sequence[int], max_new_tokens: int,
                  capacity: int | None = None, verify_rows: int = 0) -> int:
    """Validates a generation request and returns the cache capacity to use.

    The prompt plus `max_new_tokens` must fit the model's context; with speculative decoding the cache also
    holds `verify_rows` (gamma + 1) rows the verification writes past the accepted tokens (never kept, so not
    counted against the context). capacity None: the prompt, new tokens and verification rows rounded up to 128
    (past the context when it is not a multiple of 128: a block or page method needs a capacity its block divides,
    and the rows past it are never written); a capacity given may not exceed that rounding of the context."""
    if len(prompt_lengths) == 0:
        raise ValueError("no prompts given: expected at least one")
    if min(prompt_lengths) <= 0:
        raise ValueError(f"empty prompt (prompt lengths {list(prompt_lengths)}): expected at least one token")
    for name, value in (("max_new_tokens", max_new_tokens), ("capacity", capacity)):
        if (value is not None or name == "max_new_tokens") and (isinstance(value, bool) or
                                                                not isinstance(value, (int, np.integer))):
            raise ValueError(f"{name}={value!r}: expected an integer")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: expected >= 1")
    if verify_rows > cfg.max_position_embeddings:
        raise ValueError(f"gamma + 1 = {verify_rows} verification rows in one forward: expected at most the model's "
                         f"context of {cfg.max_position_embeddings} (a smaller gamma)")
    need = max(prompt_lengths) + max_new_tokens
    if need > cfg.max_position_embeddings:
        raise ValueError(f"prompt ({max(prompt_lengths)} tokens) plus max_new_tokens={max_new_tokens} is {need} "
                         f"tokens, longer than the model's context of {cfg.max_position_embeddings}")
    if capacity is None:
        return round_up(need + verify_rows, 128)
    check_count("capacity", capacity, "KV cache rows")
    check_capacity_fits(cfg, capacity, verify_rows)
    if need + verify_rows > capacity:
        rows = f" and gamma + 1 = {verify_rows} verification rows" if verify_rows else ""
        raise ValueError(f"prompt ({max(prompt_lengths)} tokens) plus max_new_tokens={max_new_tokens}{rows} is "
                         f"{need + verify_rows} tokens, longer than the KV cache capacity of {capacity}")
    return capacity


def check_count(name: str, value, what: str = "") -> int:
    """`value` as an int when it is an integer >= 1 (a Python or numpy integer, not a bool), else ValueError naming
    it (`what`: what it counts, for the message)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}={value!r}: expected an integer >= 1{f' ({what})' if what else ''}")
    return int(value)


def check_seed(seed) -> int:
    """`seed` as an int when it is an integer (not a bool) in the signed 64-bit range (see `seed_key`)."""
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)) or \
            not -(2 ** 63) <= int(seed) < 2 ** 63:
        raise ValueError(f"seed={seed!r}: expected an integer in [-2**63, 2**63)")
    return int(seed)


def seed_key(seed) -> jax.Array:
    """The PRNG key of a sampling seed (checked by `check_seed`), using all 64 bits: without jax_enable_x64,
    `jax.random.key` keeps a seed's low 32 bits only, so 5 and 2**32 + 5 sampled alike. A seed in [0, 2**32) keeps
    the key `jax.random.key(seed)`; another folds its high 32 bits (two's complement) into the key of its low 32."""
    s = check_seed(seed) % 2 ** 64
    lo, hi = s & 0xFFFFFFFF, s >> 32
    key = jax.random.key(lo)
    return key if hi == 0 else jax.random.fold_in(key, hi)


def check_token_ids(cfg: ModelConfig, rows: Sequence[Sequence[int]], what: str = "prompt") -> None:
    """Every row a flat sequence of token ids, each an integer (not a float or a bool, which would be truncated or
    read as 0 / 1) in [0, vocab_size): an id outside would read no embedding row (NaN logits) or wrap."""
    for i, row in enumerate(rows):
        where = f"{what} {i}" if len(rows) > 1 or what == "prompt" else what
        if isinstance(row, (str, bytes)) or not hasattr(row, "__len__"):
            raise ValueError(f"{where} is {reprlib.repr(row)}: expected a sequence of integer token ids")
        try:
            ids = np.asarray(row)  # one pass in numpy: prompts may hold 100K tokens
        except ValueError:  # ragged nesting
            ids = None
        if ids is None or ids.ndim != 1:
            raise ValueError(f"{where} is nested ({reprlib.repr(row)}): expected a flat sequence of integer token ids")
        if isinstance(row, (list, tuple)) and ids.dtype != np.bool_ and \
                not {bool, np.bool_}.isdisjoint(map(type, row)):  # numpy reads [True, 5] as integers
            raise ValueError(f"{where} holds a bool among its token ids: expected integer token ids")
        if ids.size and (ids.dtype == np.bool_ or not np.issubdtype(ids.dtype, np.integer)):
            raise ValueError(f"{where} has token ids of dtype {ids.dtype} (first {ids[0]!r}): expected integer "
                             "token ids")
        ids = ids.astype(np.int64)
        bad = ids[(ids < 0) | (ids >= cfg.vocab_size)]
        if bad.size:
            raise ValueError(f"{where} has token id {int(bad[0])}: expected ids in [0, {cfg.vocab_size}) (the model's "
                             "vocabulary)")


def default_unroll_layers() -> bool:
    """Whether `generate_tokens` unrolls each decode step's layer scan by default: on a GPU. There the rolled scan
    pays each layer a loop counter, slices and an idle gap at the iteration's boundary (about 4-6 us a layer);
    unrolled, every method's decode step at 16 steps a call was faster on the H100 (Llama-3.1-8B shapes, 100K,
    batch 4: dense 23.06 -> 22.90 ms, EvoSparse 8.46 -> 8.29, Kascade 9.95 -> 9.81, H2O 8.57 -> 8.47;
    `eval/results/h100/unroll_lead/NOTES.md`). Elsewhere (CPU, TPU: not measured) the rolled scan compiles faster."""
    return jax.default_backend() == "gpu"


def generate_tokens(params: Params, method, tokens: Array, lengths: Array, key: Array, *, cfg: ModelConfig,
                    max_new_tokens: int, capacity: int, sampling: Sampling = Sampling(),
                    eos_ids: tuple[int, ...] = (), return_prefill_state: bool = False,
                    unroll_layers: bool | None = None):
    """Prefill + decode loop in one jitted computation.

    Args:
      tokens: i32[B, T] right-padded prompts; lengths: i32[B].
      method: an attention method (a pytree); key: PRNG key (unused when greedy).
      max_new_tokens, capacity: integers >= 1 (static: one compilation per capacity and per bucket of
        NEW_TOKENS_BUCKET new tokens; the loop stops at max_new_tokens, a traced count).
      return_prefill_state: also return the method's selection state right after the prefill (what a method's
        `prefill_layer_sparsity` reads), so that measuring the prefill needs no second prefill.
      unroll_layers: unroll each decode step's layer scan in full (`llama.decode(unroll=True)`; static): no loop
        bookkeeping per layer, a longer compilation. None: `default_unroll_layers()` (on a GPU).
    Returns:
      (out: i32[B, max_new_tokens] generated tokens, -1 after a row's EOS; num: i32[B] tokens generated per
       row, the EOS included), then the prefill's state when `return_prefill_state`. max_new_tokens, capacity,
      the tokens' dtype and, when concrete, their ids (`llama.check_token_array`) are checked here, before the jit
      (inside it the ids are traced); the other request limits are not (the lengths are traced: `check_request` is
      the caller's): a row whose logits come back NaN (a length past the prompt, a write past the cache: the
      garbage `llama.prefill` / `decode` mark so) ends there, its tokens -1 from that step and not counted,
      instead of argmax's token 0.

    Raises:
      ValueError: max_new_tokens or capacity is not an integer >= 1 (a float or a bool included), or tokens is not
        an integer [B, T] array, or a concrete token id lies outside [0, cfg.vocab_size).
    """
    check_count("max_new_tokens", max_new_tokens)
    check_count("capacity", capacity, "KV cache rows")
    llama.check_token_array(cfg, tokens)
    # The loop's output width in buckets, its stop at max_new_tokens traced: one compilation serves a bucket.
    res = _generate_tokens(params, method, tokens, lengths, key, cfg=cfg,
                           max_new_tokens=round_up(max_new_tokens, NEW_TOKENS_BUCKET), capacity=capacity,
                           sampling=sampling, eos_ids=eos_ids, return_prefill_state=return_prefill_state,
                           limit=jnp.int32(max_new_tokens),
                           unroll_layers=default_unroll_layers() if unroll_layers is None else bool(unroll_layers))
    return (res[0][:, :max_new_tokens],) + tuple(res[1:])


@functools.partial(model_jit, static_argnames=("cfg", "max_new_tokens", "capacity", "eos_ids",
                                             "return_prefill_state", "unroll_layers"))
def _generate_tokens(params: Params, method, tokens: Array, lengths: Array, key: Array, *, cfg: ModelConfig,
                     max_new_tokens: int, capacity: int, sampling: Sampling = Sampling(),
                     eos_ids: tuple[int, ...] = (), return_prefill_state: bool = False, limit: Array | None = None,
                     unroll_layers: bool = False):
    """The jitted computation of `generate_tokens` (its arguments checked there; `generate_tokens.lower` is this
    function's, unchecked): max_new_tokens the output's width, limit (i32[], traced; None: max_new_tokens) the
    steps run."""
    B = tokens.shape[0]
    cache = sharding.constrain(init_cache(cfg, B, capacity, params.embed.dtype), cache_axes())
    state = method.init_state(cfg, B, capacity)
    logits, cache, state = llama.prefill(params, cfg, method, tokens, lengths, cache, state)
    prefill_state = state
    key, sub = jax.random.split(key)
    tok = sample(logits, sub, sampling)
    bad = jnp.any(jnp.isnan(logits), axis=-1)  # garbage: the row ends with no token
    eos = stop_ids(eos_ids)
    out = jnp.full((B, max_new_tokens), -1, jnp.int32).at[:, 0].set(jnp.where(bad, -1, tok))
    done = jnp.isin(tok, eos) | bad
    num = (~bad).astype(jnp.int32)

    stop = max_new_tokens if limit is None else jnp.minimum(limit, max_new_tokens)
    _, _, _, _, out, num, _ = decode_loop(params, method, tok, cache, state, key, cfg=cfg, sampling=sampling,
                                          eos=eos, stop=stop, out=out, done=done, num=num,
                                          unroll=True if unroll_layers else 1)
    return (out, num, prefill_state) if return_prefill_state else (out, num)


def decode_loop(params: Params, method, tok: Array, cache: KVCache, state, key: Array, *, cfg: ModelConfig,
                sampling: Sampling, eos: Array, stop, out: Array, done: Array, num: Array, unroll: int | bool = 1):
    """The decode loop of `generate_tokens` (traced inside its jit; also what `jsparse bench model --loop generate`
    times): from step 1 (the prefill wrote step 0) while step < stop (traced or static) and some row is not done, one
    `llama.decode` step, a token sampled per row, written into out[:, step] (-1 for a done row), num counted and done
    updated (an `eos` token, or NaN logits: garbage, the row ends uncounted).

    Args: tok i32[B] the last tokens; key the PRNG key (split each step); eos i32[E] the stop ids (`stop_ids`); out
      i32[B, W] (W >= stop), done bool[B], num i32[B] as the prefill left them; unroll: each step's layer scan's
      (`llama.decode`'s; True unrolls it in full).
    Returns: (tok, cache, state, done, out, num, key) after the last step."""

    def cond(c):
        step, _, _, _, done, _, _, _ = c
        return (step < stop) & ~jnp.all(done)

    def body(c):
        step, tok, cache, state, done, out, num, key = c
        logits, cache, state = llama.decode(params, cfg, method, tok[:, None], cache, state, unroll=unroll)
        key, sub = jax.random.split(key)
        new = sample(logits[:, 0], sub, sampling)
        done = done | jnp.any(jnp.isnan(logits[:, 0]), axis=-1)  # garbage (a write past the cache): the row ends
        new = jnp.where(done, -1, new)
        out = jax.lax.dynamic_update_slice(out, new[:, None], (0, step))
        num = num + (~done).astype(jnp.int32)
        done = done | jnp.isin(new, eos)
        return step + 1, jnp.where(new < 0, tok, new), cache, state, done, out, num, key

    init = (jnp.int32(1), tok, cache, state, done, out, num, key)
    return jax.lax.while_loop(cond, body, init)[1:]


# The jitted function's tools on the checked entry point: `generate_tokens.lower(...)`, its compilation cache.
for _name in ("lower", "trace", "eval_shape", "clear_cache", "_clear_cache", "_cache_size"):
    setattr(generate_tokens, _name, getattr(_generate_tokens, _name))
del _name


@functools.partial(model_jit, static_argnames=("cfg", "all_logits"), donate_argnames=("cache",))
def _prefill_step(params, method, tokens, lengths, cache, state, *, cfg, all_logits):
    return llama.prefill(params, cfg, method, tokens, lengths, cache, state, all_logits=all_logits)


@functools.partial(model_jit, static_argnames=("cfg",), donate_argnames=("cache",))
def _decode_step(params, method, tokens, cache, state, *, cfg):
    return llama.decode(params, cfg, method, tokens, cache, state)


def prefill_step(params: Params, method, tokens: Array, lengths: Array, cache: KVCache, state, *,
                 cfg: ModelConfig, all_logits: bool = False):
    """Jitted `llama.prefill` with the cache donated; the request is checked first (`llama.check_prefill_request`
    raises naming the bad value)."""
    llama.check_prefill_request(cfg, tokens, lengths, cache)
    return _prefill_step(params, method, tokens, lengths, cache, state, cfg=cfg, all_logits=all_logits)


def decode_step(params: Params, method, tokens: Array, cache: KVCache, state, *, cfg: ModelConfig):
    """Jitted `llama.decode` (one step of T tokens) with the cache donated; the request is checked first
    (`llama.check_decode_request`, which reads the cache lengths on the host: a loop that must not wait on the
    device each step runs `llama.decode` inside its own jit, where a bad row gets NaN logits)."""
    llama.check_decode_request(cfg, tokens, cache)
    return _decode_step(params, method, tokens, cache, state, cfg=cfg)


# ----------------------------------------------------------------------------------------------- on a mesh


@functools.lru_cache(maxsize=32)
def sharded_fns(mesh, cfg: ModelConfig, batch: int, capacity: int, all_logits: bool = False):
    """(prefill, decode, param shardings, cache shardings): `llama.prefill(params, method, tokens, lengths, cache,
    state)` and `llama.decode(params, method, tokens, cache, state)` jitted with in/out shardings on `mesh`
    (models.sharding), the cache donated; call them with the mesh set (`sharding.use_mesh(mesh)`) so the kernels
    run per shard. No request checks (see `sharded_prefill_step` / `sharded_decode_step`)."""
    params_sh = sharding.param_shardings(cfg, mesh)
    cache_sh = sharding.cache_sharding_for(cfg, batch, capacity, mesh)
    rows, rows2, rows3 = (sharding.batch_sharding(mesh, n) for n in (1, 2, 3))
    logits_sh = rows3 if all_logits else rows2
    prefill = model_jit(
        lambda params, method, tokens, lengths, cache, state: llama.prefill(
            params, cfg, method, tokens, lengths, cache, state, all_logits=all_logits),
        in_shardings=(params_sh, None, rows2, rows, cache_sh, None), out_shardings=(logits_sh, cache_sh, None),
        donate_argnums=(4,))
    decode = model_jit(
        lambda params, method, tokens, cache, state: llama.decode(params, cfg, method, tokens, cache, state),
        in_shardings=(params_sh, None, rows2, cache_sh, None), out_shardings=(rows3, cache_sh, None),
        donate_argnums=(3,))
    return prefill, decode, params_sh, cache_sh


def _place(mesh, cfg, params, tokens, cache, all_logits, lengths=None):
    sharding.check_unfused(params)  # (the cached shardings are of the separate layout: device_put would fail)
    fns = sharded_fns(mesh, cfg, tokens.shape[0], cache.capacity, all_logits)
    params, cache = jax.device_put(params, fns[2]), jax.device_put(cache, fns[3])
    tokens = sharding.shard_batch(tokens, mesh)
    lengths = None if lengths is None else sharding.shard_batch(lengths, mesh)
    return fns, params, tokens, lengths, cache


def sharded_prefill_step(mesh, params: Params, method, tokens: Array, lengths: Array, cache: KVCache, state, *,
                         cfg: ModelConfig, all_logits: bool = False):
    """`prefill_step` on `mesh`: params / cache / tokens / lengths placed by `models.sharding` (arrays already
    placed so are not moved; host arrays are copied shard by shard), the selection state by
    `sharding.state_shardings`, and the jitted prefill runs with the mesh set (its kernels per shard).

    Returns (logits rows over data, cache on the mesh, state)."""
    llama.check_prefill_request(cfg, tokens, lengths, cache)
    sharding.check_batch(tokens.shape[0], mesh)
    fns, params, tokens, lengths, cache = _place(mesh, cfg, params, tokens, cache, all_logits, lengths)
    state = sharding.shard_state(state, cfg, tokens.shape[0], mesh)
    with sharding.use_mesh(mesh):
        return fns[0](params, method, tokens, lengths, cache, state)


def sharded_decode_step(mesh, params: Params, method, tokens: Array, cache: KVCache, state, *, cfg: ModelConfig):
    """`decode_step` on `mesh` (see `sharded_prefill_step`); returns (f32[B, T, V] rows over data, cache, state)."""
    llama.check_decode_request(cfg, tokens, cache)
    sharding.check_batch(tokens.shape[0], mesh)
    fns, params, tokens, _, cache = _place(mesh, cfg, params, tokens, cache, False)
    state = sharding.shard_state(state, cfg, tokens.shape[0], mesh)
    with sharding.use_mesh(mesh):
        return fns[1](params, method, tokens, cache, state)


def sharded_generate_tokens(mesh, params: Params, method, tokens: Array, lengths: Array, key: Array, *,
                            cfg: ModelConfig, max_new_tokens: int, capacity: int, sampling: Sampling = Sampling(),
                            eos_ids: tuple[int, ...] = ()):
    """`generate_tokens` on `mesh`: params placed by `models.sharding` (a no-op when already placed), the prompt
    rows over data, the whole prefill + decode loop one jitted computation with the mesh set (cache and
    selection state sharded by heads and rows inside it). Returns what `generate_tokens` returns."""
    sharding.check_heads(cfg, mesh)
    sharding.check_batch(tokens.shape[0], mesh)
    params = jax.device_put(params, sharding.param_shardings(cfg, mesh, params))
    tokens, lengths = sharding.shard_batch(tokens, mesh), sharding.shard_batch(lengths, mesh)
    with sharding.use_mesh(mesh):
        return generate_tokens(params, method, tokens, lengths, key, cfg=cfg, max_new_tokens=max_new_tokens,
                               capacity=capacity, sampling=sampling, eos_ids=eos_ids)
