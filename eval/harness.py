"""The evaluation harness: every (method, task, length) of a run, as a list of flat records.

    from eval.harness import EvalSpec, evaluate
    run = evaluate(model, EvalSpec(methods=("dense", "kascade"), tasks=("passkey", "ppl"), lengths=(2048,),
                                   artifacts={"kascade": "artifacts/kascade"}))
    run.records  # [{task, method, length, budget, budget_tokens, metric, value, sparsity, layer_sparsity, n,
                 #   variant, depth, seconds}, ...]

A record (every record has exactly the keys of `RECORD_KEYS`):
  task      "passkey" or "ppl"
  method    the method's registry name
  length    the prompt / window length in tokens
  budget    the budget the method was built with (fraction of the context in (0, 1]); with a token budget,
            budget_tokens / length
  budget_tokens
            the fixed token budget N of this record (`EvalSpec.budget_tokens`): every query attends to
            k = min(N, p + 1) keys (p its position); None when the fraction rule was used or the method takes
            no budget (dense, tsa)
  metric    "accuracy" (passkey: exact match of the key's digits) or "perplexity"
  value     the metric's value
  sparsity  achieved sparsity: fraction of visible keys not attended, averaged over layers and the query
            positions 0..length-1, from `method.achieved_sparsity(cfg, positions)`; 0.0 for dense; None when
            the method does not report it. For a method that measures its prefill (TSA, see layer_sparsity),
            the measured attention-map sparsity of the record's prefills averaged over all layers (dense
            layers count 0)
  layer_sparsity
            {layer (str): attention-map sparsity} of each sparse layer, measured on the record's prefills and
            averaged over the samples, for methods with `prefill_layer_sparsity` (TSA: the fraction of the
            causal attention map its compression skips, the paper's Table 3); None otherwise (and for the ppl
            "decode" variant, which runs no prefill)
  n         samples behind the value (prompts or windows)
  variant   ppl: "decode", "prefill" or "continuation" (see eval/ppl.py); passkey: "generate" (the method's prefill of the
            prompt, then its decode of the answer, as `jsparse generate` runs it)
  depth     passkey: the needle depth of a per-depth record, None for the record over all depths; ppl: None
  seconds   wall time of this (method, task, variant, length), compilation included
  acceptance_rate
            passkey with a draft (`EvalSpec.draft`, speculative decoding): accepted draft tokens / proposed ones
            over the record's rounds; None otherwise

Speed: prompts and windows are built once per length and shared by every method; samples are batched
(`max_batch_tokens` tokens per forward, the last batch padded by repeating rows so one (method, length)
compiles once); compiled functions are module-level `jax.jit`s reused across samples and batches.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from eval import passkey as passkey_task
from eval import ppl as ppl_task
from models.generate import Sampling, check_request, generate_tokens

TASKS = ("passkey", "ppl")
STS_PPL_VARIANTS = ("prefill", "continuation")  # STS-P; STS-D (teacher-forced verification rounds)
RECORD_KEYS = ("task", "method", "length", "budget", "budget_tokens", "metric", "value", "sparsity",
               "layer_sparsity", "n", "variant", "depth", "seconds", "acceptance_rate")


def method_names() -> list[str]:
    from jsparse.methods import method_names as names

    return names()


def parse_list(text: str | Sequence[str], what: str) -> tuple[str, ...]:
    """'a,b, c' -> ('a', 'b', 'c'); raises naming `what` when empty."""
    items = text.split(",") if isinstance(text, str) else list(text)
    items = tuple(i.strip() for i in items if i.strip())
    if not items:
        raise ValueError(f"{what}: expected a comma-separated list with at least one item, got {text!r}")
    return items


def check_methods(methods: Sequence[str]) -> tuple[str, ...]:
    valid = method_names()
    for m in methods:
        if m not in valid:
            raise ValueError(f"unknown method {m!r}; valid methods: {', '.join(valid)}")
    if len(set(methods)) != len(methods):
        raise ValueError(f"methods {list(methods)} name a method twice")
    return tuple(methods)


def check_tasks(tasks: Sequence[str]) -> tuple[str, ...]:
    for t in tasks:
        if t not in TASKS:
            raise ValueError(f"unknown task {t!r}; valid tasks: {', '.join(TASKS)}")
    if len(set(tasks)) != len(tasks):
        raise ValueError(f"tasks {list(tasks)} name a task twice")
    return tuple(tasks)


def parse_lengths(text: str | Sequence[int]) -> tuple[int, ...]:
    items = parse_list(text, "--lengths") if isinstance(text, str) else tuple(text)
    out = []
    for i in items:
        try:
            n = int(i)
        except (TypeError, ValueError):
            raise ValueError(f"length {i!r}: expected a positive integer number of tokens") from None
        if n < 16:
            raise ValueError(f"length {n}: expected an integer >= 16 tokens")
        out.append(n)
    return tuple(out)


def components(method: str) -> tuple[str, ...]:
    """The component methods of a composed method name ('tsa+kascade' -> ('tsa', 'kascade')); () otherwise."""
    parts = tuple(method.split("+"))
    return parts if len(parts) > 1 else ()


def parse_artifacts(values: Sequence[str] | None, methods: Sequence[str]) -> dict[str, str]:
    """Artifact folders per method from `--artifact` values: 'DIR' (every method) or 'NAME=DIR' (one).

    Values may be repeated or comma-separated; a NAME=DIR entry wins over a plain DIR for its method. NAME may
    also be a component of a composed method: `--artifact kascade=K --artifact tsa=T` gives `--methods
    tsa+kascade` the folders 'K' + os.pathsep + 'T' (the composed builder routes each by its kind), unless a
    'tsa+kascade=...' entry names the composed method itself.
    """
    import os

    common, per, parts = None, {}, {}
    used = {c for m in methods for c in components(m)}
    for value in values or ():
        for item in parse_list(value, "--artifact"):
            name, sep, path = item.partition("=")
            if sep and (name in methods or name in used):
                if name in methods:
                    per[name] = path
                if name in used:
                    parts[name] = path
            elif sep and name in method_names():
                raise ValueError(f"--artifact {item!r} names method {name!r}, which is not in --methods "
                                 f"{','.join(methods)}")
            elif sep and "/" not in name and "\\" not in name:
                raise ValueError(f"--artifact {item!r}: unknown method {name!r}; valid methods: "
                                 f"{', '.join(methods)}")
            else:
                if common is not None:
                    raise ValueError(f"--artifact gives two folders for every method ({common!r} and {item!r}); "
                                     "use NAME=DIR for per-method artifacts")
                common = item
    out = {m: common for m in methods if common is not None}
    for m in methods:
        given = [parts[c] for c in components(m) if c in parts]
        if given:
            out[m] = os.pathsep.join(given)
    out.update(per)
    return out


def parse_budget_tokens(text: str | Sequence[int] | None) -> tuple[int, ...] | None:
    """'256,512' -> (256, 512): fixed token budgets (positive integers); None/'' -> None (the fraction rule)."""
    if text is None or (isinstance(text, str) and not text.strip()):
        return None
    items = parse_list(text, "--budget-tokens") if isinstance(text, str) else tuple(text)
    out = []
    for i in items:
        try:
            n = int(i)
        except (TypeError, ValueError):
            raise ValueError(f"budget tokens {i!r}: expected a positive integer number of tokens") from None
        if isinstance(i, float) and i != n or n < 1:
            raise ValueError(f"budget tokens {i!r}: expected a positive integer number of tokens")
        out.append(n)
    if len(set(out)) != len(out):
        raise ValueError(f"--budget-tokens {list(out)} names a budget twice")
    return tuple(out)


def _option_value(text: str):
    import json

    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_method_options(values: Sequence[str] | None, methods: Sequence[str]) -> dict[str, dict]:
    """`--method-option NAME.KEY=VALUE` values (repeatable, comma-separated) -> {NAME: {KEY: VALUE}}.

    VALUE is read as JSON when it parses (0.01, 3, true, [3, 4]) and as a string otherwise; NAME must be one of
    `methods`. Each option is a keyword of the method's builder (e.g. tsa.tau=0.01).
    """
    out: dict[str, dict] = {}
    for value in values or ():
        for item in parse_list(value, "--method-option"):
            key, sep, raw = item.partition("=")
            name, dot, field = key.rpartition(".")
            if not sep or not dot or not name or not field:
                raise ValueError(f"--method-option {item!r}: expected METHOD.OPTION=VALUE, e.g. tsa.tau=0.01")
            if name not in methods:
                raise ValueError(f"--method-option {item!r} names method {name!r}, which is not in --methods "
                                 f"{','.join(methods)}")
            out.setdefault(name, {})[field] = _option_value(raw)
    return out


@dataclasses.dataclass(frozen=True)
class EvalSpec:
    """What one evaluation run measures.

    Attributes:
      methods: registry names of the methods; tasks: subset of TASKS; lengths: prompt lengths in tokens.
      budget: the budget every sparse method is built with, in (0, 1].
      samples: passkey prompts / ppl windows per length (passkey depths cycle over the samples: sample i has
        depth depths[i % len(depths)]).
      seed: seeds the passkey keys and filler and the ppl window offsets.
      corpus: the ppl corpus (a UTF-8 text file); artifacts: method name -> artifact folder.
      depths: passkey needle depths; ppl_variants: subset of ("decode", "prefill", "continuation").
      haystack: the passkey filler, "repeat" (the classic sentences) or "corpus" (stretches of `corpus`).
      continuation: C, the scored tokens of the ppl "continuation" variant (the prompt is the rest).
      budget_tokens: fixed token budgets N, or None for the fraction rule (`budget`). Each N runs every method
        that takes a budget with k = min(N, p + 1) keys per query at position p: TokenBudget methods (and
        compositions around one) get budget = N / (length + new_tokens) and min_tokens = N, methods with a
        `budget_tokens` field (EvoSparse) get budget_tokens = N; methods without a budget (dense, tsa) run once
        per length.
      method_options: method name -> extra keyword options of its builder (e.g. {"tsa": {"tau": 0.01}}).
      new_tokens: tokens generated greedily for a passkey answer.
      chunk: tokens per decode call in the ppl "decode" variant.
      max_batch_tokens: rows per forward = max(1, max_batch_tokens // length).
    """

    methods: tuple[str, ...]
    tasks: tuple[str, ...] = TASKS
    lengths: tuple[int, ...] = (2048, 4096)
    budget: float = 0.1
    samples: int = 10
    seed: int = 0
    corpus: str | None = ppl_task.DEFAULT_CORPUS
    artifacts: Mapping[str, str] = dataclasses.field(default_factory=dict)
    depths: tuple[float, ...] = passkey_task.DEFAULT_DEPTHS
    haystack: str = "repeat"
    ppl_variants: tuple[str, ...] = ppl_task.DEFAULT_VARIANTS
    continuation: int = ppl_task.DEFAULT_CONTINUATION
    budget_tokens: tuple[int, ...] | None = None
    method_options: Mapping[str, Mapping] = dataclasses.field(default_factory=dict)
    new_tokens: int = 8
    chunk: int = 512
    max_batch_tokens: int = 8192
    draft: object = None
    gamma: int = 4

    def validate(self) -> "EvalSpec":
        check_methods(self.methods)
        check_tasks(self.tasks)
        parse_lengths(self.lengths)
        if not 0.0 < self.budget <= 1.0:
            raise ValueError(f"budget={self.budget}: expected a fraction in (0, 1]")
        for name, value in (("samples", self.samples), ("new_tokens", self.new_tokens), ("chunk", self.chunk),
                            ("max_batch_tokens", self.max_batch_tokens)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: expected a positive integer")
        passkey_task.check_depths(self.depths)
        passkey_task.check_haystack(self.haystack)
        ppl_task.check_variants(self.ppl_variants)
        if not isinstance(self.gamma, int) or self.gamma < 1:
            raise ValueError(f"gamma={self.gamma!r}: expected an integer >= 1 (draft tokens proposed per round)")
        if "sts" in self.methods:
            if self.draft is None:
                raise ValueError("method 'sts' needs a draft model: pass --draft (EvalSpec.draft)")
            other = [v for v in self.ppl_variants if v not in STS_PPL_VARIANTS] if "ppl" in self.tasks else []
            if other:
                raise ValueError(f"method 'sts' runs perplexity as ppl variants {list(STS_PPL_VARIANTS)} only (STS-P: "
                                 f"the draft's prefill chooses the target's keys; STS-D: teacher-forced verification "
                                 f"rounds), got variants {list(self.ppl_variants)}: pass --ppl-variants prefill,continuation")
        if "ppl" in self.tasks and "continuation" in self.ppl_variants:
            for length in self.lengths:
                ppl_task.check_continuation(self.continuation, length)
        if self.budget_tokens is not None:
            parse_budget_tokens(self.budget_tokens)
        for name in self.method_options:
            if name not in self.methods:
                raise ValueError(f"method options given for method {name!r}, which is not among the methods "
                                 f"{list(self.methods)}")
        for name in self.artifacts:
            if name not in self.methods:
                raise ValueError(f"artifact given for method {name!r}, which is not among the methods "
                                 f"{list(self.methods)}")
        return self

    def batch_rows(self, length: int) -> int:
        return max(1, min(self.samples, self.max_batch_tokens // length))


@dataclasses.dataclass
class EvalRun:
    """records: the flat records (see the module docstring); passkey_outputs: one dict per passkey sample
    (method, length, depth, key, completion, correct) for reading failures."""

    records: list[dict]
    passkey_outputs: list[dict]


OPTIONAL_KEYS = {"budget_tokens": None, "layer_sparsity": None, "acceptance_rate": None}  # None when not given


def make_record(**fields) -> dict:
    fields = {**OPTIONAL_KEYS, **fields}
    missing = [k for k in RECORD_KEYS if k not in fields] + [k for k in fields if k not in RECORD_KEYS]
    if missing:
        raise KeyError(f"record keys {missing} do not match {RECORD_KEYS}")
    return {k: fields[k] for k in RECORD_KEYS}


def achieved_sparsity(method, name: str, cfg, length: int) -> float | None:
    """The method's achieved sparsity over query positions 0..length-1 (0.0 for dense, None if unreported)."""
    fn = getattr(method, "achieved_sparsity", None)
    if fn is None:
        return 0.0 if name == "dense" else None
    return float(fn(cfg, np.arange(length, dtype=np.int32)))


def _batches(rows: np.ndarray, size: int):
    """Yields (batch i32[size, T], valid rows) with the last batch padded by repeating its last row."""
    for s in range(0, len(rows), size):
        part = rows[s:s + size]
        valid = len(part)
        if valid < size:
            part = np.concatenate([part, np.repeat(part[-1:], size - valid, axis=0)])
        yield part, valid


def _eos_ids(model) -> tuple[int, ...]:
    eos = tuple(model.cfg.eos_token_ids)
    tok_eos = getattr(model.tokenizer, "eos_token_id", None)
    if tok_eos is not None and tok_eos not in eos:
        eos = eos + (tok_eos,)
    return eos


class LayerSparsity:
    """Accumulates a method's measured prefill sparsity per layer over the samples (valid rows only)."""

    def __init__(self, method, cfg):
        self.fn = getattr(method, "prefill_layer_sparsity", None)
        self.cfg = cfg
        self.rows: dict[int, list] = {}

    @property
    def active(self) -> bool:
        return self.fn is not None

    def add(self, state, lengths, valid: int) -> None:
        if self.fn is None:
            return
        for layer, values in self.fn(self.cfg, state, np.asarray(lengths)).items():
            self.rows.setdefault(int(layer), []).extend(np.asarray(values, np.float64)[:valid].tolist())

    def result(self) -> tuple[dict | None, float | None]:
        """({layer (str): mean over samples}, mean over all layers with dense layers as 0), or (None, None)."""
        if not self.rows:
            return None, None
        per = {str(layer): float(np.mean(v)) for layer, v in sorted(self.rows.items())}
        return per, float(sum(per.values()) / self.cfg.num_layers)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _prefill_state_jit(params, method, tokens, lengths, *, cfg):
    from models import llama
    from models.cache import init_cache

    B, T = tokens.shape
    cache = init_cache(cfg, B, T, params.embed.dtype)
    _, _, state = llama.prefill(params, cfg, method, tokens, lengths, cache, method.init_state(cfg, B, T))
    return state


def prefill_state(model, method, tokens: np.ndarray, lengths: np.ndarray):
    """The method's state after its prefill of `tokens` (i32[B, T], right-padded to `lengths`)."""
    return _prefill_state_jit(model.params, method, jnp.asarray(tokens), jnp.asarray(lengths), cfg=model.cfg)


def run_passkey(model, method, prompts: Sequence[passkey_task.PasskeyPrompt], new_tokens: int, rows: int,
                tick: Callable[[], None] = lambda: None, layer_sparsity: LayerSparsity | None = None,
                draft=None, gamma: int = 4, stats: dict | None = None) -> list[str]:
    """Greedy completions (text) of the prompts, `rows` prompts per generate call (and, given `layer_sparsity`
    of a method that measures its prefill, one more prefill per batch to measure it). With `draft`, speculative
    decoding (gamma tokens per round; STS takes its selection from the draft); `stats` then receives
    `rounds` and `accepted` summed over the prompts."""
    if draft is not None:
        return _run_passkey_speculative(model, method, prompts, new_tokens, rows, tick, draft, gamma, stats)
    length = len(prompts[0].tokens)
    capacity = check_request(model.cfg, [length], new_tokens)
    eos = _eos_ids(model)
    tokens = np.stack([p.tokens for p in prompts])
    lengths = jnp.full((rows,), length, jnp.int32)
    completions = []
    for batch, valid in _batches(tokens, rows):
        out, num = generate_tokens(model.params, method, jnp.asarray(batch), lengths, jax.random.key(0),
                                   cfg=model.cfg, max_new_tokens=new_tokens, capacity=capacity,
                                   sampling=Sampling(), eos_ids=eos)
        out, num = np.asarray(out), np.asarray(num)
        for row, n in zip(out[:valid], num[:valid]):
            ids = [int(t) for t in row[:n] if t >= 0 and int(t) not in eos]
            completions.append(model.tokenizer.decode(ids, skip_special_tokens=True))
        if layer_sparsity is not None and layer_sparsity.active:
            layer_sparsity.add(prefill_state(model, method, batch, lengths), lengths, valid)
        tick()
    return completions


def _run_passkey_speculative(model, method, prompts, new_tokens, rows, tick, draft, gamma, stats):
    from jsparse.api import check_draft, speculative_methods
    from models.generate import round_up
    from models.speculative import speculative_generate

    check_draft(model, draft, gamma)
    length = len(prompts[0].tokens)
    check_request(model.cfg, [length], new_tokens + gamma + 1)
    capacity = round_up(length + new_tokens + gamma + 1, 128)
    t_method, d_method = speculative_methods(method, model, draft, gamma)
    eos = _eos_ids(model)
    tokens = np.stack([p.tokens for p in prompts])
    lengths = jnp.full((rows,), length, jnp.int32)
    completions, rounds, accepted = [], 0, 0
    for batch, valid in _batches(tokens, rows):
        out, num, r, a = speculative_generate(
            model.params, draft.params, t_method, d_method, jnp.asarray(batch), lengths, jax.random.key(0),
            t_cfg=model.cfg, d_cfg=draft.cfg, gamma=gamma, max_new_tokens=new_tokens, capacity=capacity,
            sampling=Sampling(), eos_ids=eos)
        out, num = np.asarray(out), np.asarray(num)
        rounds += int(np.asarray(r)[:valid].sum())
        accepted += int(np.asarray(a)[:valid].sum())
        for row, n in zip(out[:valid], num[:valid]):
            ids = [int(t) for t in row[:n] if t >= 0 and int(t) not in eos]
            completions.append(model.tokenizer.decode(ids, skip_special_tokens=True))
        tick()
    if stats is not None:
        stats.update(rounds=rounds, accepted=accepted, gamma=gamma)
    return completions


@functools.partial(jax.jit, static_argnames=("t_cfg", "d_cfg"))
def _sts_prefill_nll(t_params, d_params, t_method, d_method, tokens, *, t_cfg, d_cfg):
    """STS-P perplexity: the draft's prefill records its tile-pooled rows, the target's prefill attends the keys
    they choose. tokens: i32[B, T] -> f32[B, T - 1] NLL of tokens 1..T-1."""
    from models import llama
    from models.cache import init_cache

    B, T = tokens.shape
    lengths = jnp.full((B,), T, jnp.int32)
    _, _, d_state = llama.prefill(d_params, d_cfg, d_method, tokens, lengths, init_cache(d_cfg, B, T, d_params.embed.dtype),
                                  d_method.init_state(d_cfg, B, T))
    state = t_method.adopt_draft(t_method.init_state(t_cfg, B, T), d_state)
    logits, _, _ = llama.prefill(t_params, t_cfg, t_method, tokens, lengths,
                                 init_cache(t_cfg, B, T, t_params.embed.dtype), state, all_logits=True)
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]


@functools.partial(jax.jit, static_argnames=("t_cfg", "d_cfg", "continuation", "gamma"))
def _sts_continuation_nll(t_params, d_params, t_method, d_method, tokens, *, t_cfg, d_cfg, continuation, gamma):
    """STS-D perplexity: STS-P prefill of the first P = T - C tokens, then the last C tokens teacher-forced through
    verification rounds in which every draft token is accepted: per round the draft decodes [prev, tok] and then
    gamma - 1 single tokens of the text (its last step's attention rows are the record), and the target verifies
    the gamma + 1 positions n .. n + gamma through the keys the record chooses (`models.speculative.spec_round`
    with the text as the draft's proposals). tokens: i32[B, T] -> f32[B, C] NLL of tokens P .. T - 1."""
    from models import llama
    from models.cache import init_cache
    from models.generate import round_up

    B, T = tokens.shape
    C, P, g = continuation, T - continuation, gamma
    R = -(-(C - 1) // (g + 1))  # rounds to feed tokens P .. T - 2
    feed = jnp.pad(tokens[:, P:], ((0, 0), (0, R * (g + 1) + 1 - C)))  # [B, R (g + 1) + 1]: inputs then targets
    cap = round_up(P + R * (g + 1) + 1, 128)
    lengths = jnp.full((B,), P, jnp.int32)
    d_state = d_method.init_state(d_cfg, B, cap)
    _, d_cache, d_state = llama.prefill(d_params, d_cfg, d_method, tokens[:, :P], lengths,
                                        init_cache(d_cfg, B, cap, d_params.embed.dtype), d_state)
    t_state = t_method.adopt_draft(t_method.init_state(t_cfg, B, cap), d_state)
    logits, t_cache, t_state = llama.prefill(t_params, t_cfg, t_method, tokens[:, :P], lengths,
                                             init_cache(t_cfg, B, cap, t_params.embed.dtype), t_state)
    nll0 = _nll(logits, tokens[:, P])  # token P from the prefill's last logits
    t_state, d_state = t_method.end_prefill(t_cfg, t_state, B, cap), d_method.end_prefill(d_cfg, d_state, B, cap)
    rounds = feed[:, :R * (g + 1)].reshape(B, R, g + 1)
    targets = feed[:, 1:R * (g + 1) + 1].reshape(B, R, g + 1)

    def one_round(carry, xs):
        t_cache, d_cache, t_state, d_state, prev = carry
        chunk, tgt = xs  # [B, g + 1] fed tokens (tok, d_1 .. d_g), [B, g + 1] their targets
        n = t_cache.lengths
        _, d_cache, d_state = llama.decode(d_params, d_cfg, d_method, jnp.stack([prev, chunk[:, 0]], axis=1),
                                           d_cache.replace(lengths=n - 1), d_state)
        for j in range(1, g):
            _, d_cache, d_state = llama.decode(d_params, d_cfg, d_method, chunk[:, j:j + 1], d_cache, d_state)
        t_state = t_method.adopt_draft(t_state, d_state)
        logits, t_cache, t_state = llama.decode(t_params, t_cfg, t_method, chunk, t_cache, t_state)
        nll = _nll(logits, tgt)
        d_cache = d_cache.replace(lengths=t_cache.lengths)
        return (t_cache, d_cache, t_state, d_state, chunk[:, -1]), nll

    carry = (t_cache, d_cache, t_state, d_state, tokens[:, P - 1])
    _, nll = jax.lax.scan(one_round, carry, (jnp.moveaxis(rounds, 1, 0), jnp.moveaxis(targets, 1, 0)))
    nll = jnp.moveaxis(nll, 0, 1).reshape(B, R * (g + 1))[:, :C - 1]
    return jnp.concatenate([nll0[:, None], nll], axis=1)


def _nll(logits, targets):
    """f32 NLL of targets (i32[...]) under logits [..., V]."""
    logits = logits.astype(jnp.float32)
    return jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]


def run_ppl(model, method, windows: np.ndarray, variant: str, rows: int, chunk: int,
            tick: Callable[[], None] = lambda: None, continuation: int = ppl_task.DEFAULT_CONTINUATION,
            layer_sparsity: LayerSparsity | None = None, draft=None, gamma: int = 4) -> np.ndarray:
    """Token NLLs of the windows under `variant`: f32[n, T - 1] for "decode" and "prefill", f32[n, C] for
    "continuation" (C = `continuation`). `layer_sparsity` collects the measured sparsity of the prefills.
    A method that selects from a draft (STS) needs `draft` and runs the "prefill" variant (STS-P) or the
    "continuation" variant (STS-D: its decode as teacher-forced verification rounds of `gamma` + 1 tokens)."""
    out = []
    if getattr(method, "needs_draft", False):
        if draft is None or variant not in STS_PPL_VARIANTS:
            raise ValueError(f"method 'sts' runs ppl variants {list(STS_PPL_VARIANTS)} with a draft only (got variant "
                             f"{variant!r}{'' if draft is not None else ', no draft'})")
        from jsparse.api import speculative_methods

        t_method, d_method = speculative_methods(method, model, draft, gamma)
        for batch, valid in _batches(windows, rows):
            if variant == "prefill":
                nll = _sts_prefill_nll(model.params, draft.params, t_method, d_method, jnp.asarray(batch),
                                       t_cfg=model.cfg, d_cfg=draft.cfg)
            else:
                nll = _sts_continuation_nll(model.params, draft.params, t_method, d_method, jnp.asarray(batch),
                                            t_cfg=model.cfg, d_cfg=draft.cfg,
                                            continuation=ppl_task.check_continuation(continuation, batch.shape[1]),
                                            gamma=gamma)
            out.append(np.asarray(nll)[:valid])
            tick()
        return np.concatenate(out)
    for batch, valid in _batches(windows, rows):
        if variant == "decode":
            nll = ppl_task.decode_nll(model.params, model.cfg, method, batch, chunk=chunk, on_chunk=tick)
        elif variant == "prefill":
            nll, state = ppl_task.prefill_nll_state(model.params, method, jnp.asarray(batch), cfg=model.cfg)
            nll = np.asarray(nll)
            if layer_sparsity is not None:
                layer_sparsity.add(state, np.full((len(batch),), batch.shape[1], np.int32), valid)
            tick()
        elif variant == "continuation":
            nll, state = ppl_task.continuation_nll(model.params, model.cfg, method, batch, continuation,
                                                   chunk=chunk, on_chunk=tick, return_state=True)
            if layer_sparsity is not None:
                P = batch.shape[1] - continuation
                layer_sparsity.add(state, np.full((len(batch),), P, np.int32), valid)
        else:
            ppl_task.check_variants((variant,))
        out.append(nll[:valid])
    return np.concatenate(out)


def _calls(spec: EvalSpec, runs_per_length: int) -> int:
    """Forward calls of the whole run (the progress bar's total); runs_per_length: method builds per length."""
    total = 0
    for length in spec.lengths:
        batches = -(-spec.samples // spec.batch_rows(length))
        per_method = 0
        if "passkey" in spec.tasks:
            per_method += batches
        if "ppl" in spec.tasks:
            for v in spec.ppl_variants:
                calls = {"decode": -(-length // spec.chunk), "prefill": 1,
                         "continuation": 1 + -(-spec.continuation // spec.chunk)}[v]
                per_method += batches * calls
        total += per_method * runs_per_length
    return total


def _safe_budget(tokens: int, max_visible: int) -> float:
    """The largest budget b <= 1 with ceil(b * n) <= tokens for every n <= max_visible, in float64 and float32
    (so that with min_tokens = tokens the fraction rule gives k = min(tokens, n))."""
    if tokens >= max_visible:
        return 1.0
    b = np.float32(tokens / max_visible)
    while float(np.float32(b) * np.float32(max_visible)) > tokens or float(b) * max_visible > tokens:
        b = np.nextafter(b, np.float32(0))
    return float(b)


def token_budget_options(method, tokens: int, max_visible: int) -> dict:
    """Builder options that give `method` (a built instance) the fixed budget k = min(tokens, p + 1) at every
    position p < max_visible; {} for a method without a budget (dense, tsa)."""
    from jsparse.methods.common import TokenBudget

    fields = getattr(method, "__dataclass_fields__", {})
    if getattr(method, "needs_draft", False):  # STS: budgets above 1 count tokens
        return {"budget": float(tokens) if 1 < tokens < max_visible else 1.0}
    if "budget_tokens" in fields:
        return {"budget_tokens": int(tokens)}
    inner = getattr(method, "inner", None)
    if isinstance(method, TokenBudget) or isinstance(inner, TokenBudget):
        return {"budget": _safe_budget(int(tokens), max_visible), "min_tokens": int(tokens)}
    return {}


def _check_options(method, name: str, options: Mapping) -> None:
    """--method-option keys the method (`method`, once built; else its registered options) does not take."""
    import dataclasses

    from jsparse.methods.base import method_factory, method_options

    if method is None and not dataclasses.is_dataclass(method_factory(name)):
        return  # a builder wrapping another method: make_method checks the options of what it builds
    valid = method_options(name, method)
    for key, value in options.items():
        if key not in valid:
            raise ValueError(f"--method-option {name}.{key}={value!r}: method {name!r} has no option {key!r}; its "
                             f"options are {', '.join(v for v in valid if v not in ('cfg', 'fingerprint'))}")


def build_method(model, spec: EvalSpec, name: str, **overrides):
    """Builds one method of the run with its artifact, method options and `overrides` (budget ...)."""
    import jsparse

    options = {"budget": spec.budget}
    if name == "sts":
        options["draft"] = spec.draft
    if spec.artifacts.get(name):
        options["artifact"] = spec.artifacts[name]
    options.update(spec.method_options.get(name, {}))
    options.update(overrides)
    _check_options(None, name, spec.method_options.get(name, {}))  # before building (wrappers: partial list)
    method = jsparse.build_method(name, model, **options)
    return method


def build_methods(model, spec: EvalSpec) -> dict:
    """Builds every method of the run (before any work, so a bad artifact fails fast)."""
    return {name: build_method(model, spec, name) for name in spec.methods}


def method_runs(model, spec: EvalSpec, methods: Mapping, length: int):
    """Yields (name, method, budget, budget_tokens) for one length: every method once under the fraction rule,
    or, with `spec.budget_tokens`, every budgeted method once per token budget (the others once)."""
    if spec.budget_tokens is None:
        for name, method in methods.items():
            yield name, method, spec.budget, None
        return
    max_visible = length + (spec.new_tokens if "passkey" in spec.tasks else 0)
    done = set()
    for tokens in spec.budget_tokens:
        for name, method in methods.items():
            options = token_budget_options(method, tokens, max_visible)
            if not options:
                if name not in done:
                    done.add(name)
                    yield name, method, spec.budget, None
                continue
            built = build_method(model, spec, name, **options)
            yield name, built, options.get("budget", spec.budget), int(tokens)


def evaluate(model, spec: EvalSpec, *, progress: bool = True,
             on_record: Callable[[list[dict]], None] | None = None) -> EvalRun:
    """Runs every (method, task, length) of `spec` on `model`.

    Args:
      model: a LoadedModel (anything with .cfg, .params, .tokenizer).
      spec: what to run (validated here).
      progress: show a tqdm progress bar on stderr.
      on_record: called with all records so far after each (method, task, variant, length), e.g. to write
        results.json as the run goes.
    """
    from tqdm.auto import tqdm

    spec.validate()
    cfg = model.cfg
    if getattr(model, "tokenizer", None) is None:
        raise ValueError(f"model {getattr(model, 'name', '?')!r} has no tokenizer: the eval tasks need one (a "
                         "Hugging Face folder with tokenizer files, a GGUF, or the bundled smollm2)")
    for length in spec.lengths:  # fail before any work on a length the model cannot run
        if "passkey" in spec.tasks:
            check_request(cfg, [length], spec.new_tokens)
        if "ppl" in spec.tasks:
            check_request(cfg, [length - 1], 1)
    corpus_ids = None
    if "ppl" in spec.tasks or ("passkey" in spec.tasks and spec.haystack == "corpus"):
        corpus_ids = ppl_task.tokenize_corpus(model.tokenizer, ppl_task.read_corpus(spec.corpus))
        for length in spec.lengths:  # a corpus too short for the windows fails before any work
            ppl_task.check_windows(model.tokenizer, corpus_ids, length, spec.samples)
    methods = build_methods(model, spec)
    if spec.budget_tokens is None:
        runs = len(methods)
    else:
        runs = sum(len(spec.budget_tokens) if token_budget_options(m, 1, 2) else 1 for m in methods.values())

    records: list[dict] = []
    outputs: list[dict] = []
    bar = tqdm(total=_calls(spec, runs), disable=not progress, unit="call", dynamic_ncols=True)
    tick = lambda: bar.update(1)  # noqa: E731

    def emit(new: list[dict]) -> None:
        records.extend(new)
        if on_record is not None:
            on_record(list(records))

    try:
        for length in spec.lengths:
            rows = spec.batch_rows(length)
            prompts = windows = None
            if "passkey" in spec.tasks:
                prompts = passkey_task.make_prompts(
                    model.tokenizer, length, spec.samples, spec.seed, spec.depths,
                    corpus_ids if spec.haystack == "corpus" else None)
            if "ppl" in spec.tasks:
                windows = ppl_task.make_windows(model.tokenizer, corpus_ids, length, spec.samples, spec.seed)
            for name, method, budget, budget_tokens in method_runs(model, spec, methods, length):
                sparsity = achieved_sparsity(method, name, cfg, length)
                label = name if budget_tokens is None else f"{name} k={budget_tokens}"
                common = dict(method=name, length=length, budget=budget, budget_tokens=budget_tokens)
                for task in spec.tasks:
                    if task == "passkey":
                        bar.set_description(f"{label} passkey {length}")
                        t0 = time.perf_counter()
                        measured = LayerSparsity(method, cfg)
                        spec_stats = {}
                        completions = run_passkey(model, method, prompts, spec.new_tokens, rows, tick, measured,
                                                  draft=spec.draft, gamma=spec.gamma, stats=spec_stats)
                        seconds = time.perf_counter() - t0
                        layers, mean = measured.result()
                        rate = None if not spec_stats else \
                            spec_stats["accepted"] / max(spec_stats["rounds"] * spec_stats["gamma"], 1)
                        common_t = dict(common, sparsity=sparsity if mean is None else mean,
                                        layer_sparsity=layers, acceptance_rate=rate)
                        correct = [passkey_task.is_correct(c, p.key) for p, c in zip(prompts, completions)]
                        for p, c, ok in zip(prompts, completions, correct):
                            outputs.append(dict(method=name, length=length, budget_tokens=budget_tokens,
                                                depth=p.depth, key=p.key, completion=c, correct=ok))
                        new = [make_record(task="passkey", metric="accuracy", value=float(np.mean(correct)),
                                           n=len(correct), variant="generate", depth=None, seconds=seconds,
                                           **common_t)]
                        for depth in spec.depths:
                            hits = [ok for p, ok in zip(prompts, correct) if p.depth == depth]
                            if hits:
                                new.append(make_record(task="passkey", metric="accuracy",
                                                       value=float(np.mean(hits)), n=len(hits),
                                                       variant="generate", depth=depth, seconds=None,
                                                       **common_t))
                        emit(new)
                    else:
                        for variant in spec.ppl_variants:
                            bar.set_description(f"{label} ppl-{variant} {length}")
                            t0 = time.perf_counter()
                            measured = LayerSparsity(method, cfg)
                            nll = run_ppl(model, method, windows, variant, rows, spec.chunk, tick,
                                          spec.continuation, measured, draft=spec.draft, gamma=spec.gamma)
                            seconds = time.perf_counter() - t0
                            layers, mean = measured.result()
                            emit([make_record(task="ppl", metric="perplexity", value=ppl_task.perplexity(nll),
                                              n=len(nll), variant=variant, depth=None, seconds=seconds,
                                              sparsity=sparsity if mean is None else mean,
                                              layer_sparsity=layers, **common)])
    finally:
        bar.close()
    return EvalRun(records=records, passkey_outputs=outputs)
