"""The evaluation harness: every (method, task, length) of a run, as a list of flat records.

    from eval.harness import EvalSpec, evaluate
    run = evaluate(model, EvalSpec(methods=("dense", "kascade"), tasks=("passkey", "ppl"), lengths=(2048,),
                                   artifacts={"kascade": "artifacts/kascade"}))
    run.records  # [{task, method, length, budget, metric, value, sparsity, n, variant, depth, seconds}, ...]

A record (every record has exactly the keys of `RECORD_KEYS`):
  task      "passkey" or "ppl"
  method    the method's registry name
  length    the prompt / window length in tokens
  budget    the budget the method was built with (fraction of the context in (0, 1])
  metric    "accuracy" (passkey: exact match of the key's digits) or "perplexity"
  value     the metric's value
  sparsity  achieved sparsity: fraction of visible keys not attended, averaged over layers and the query
            positions 0..length-1, from `method.achieved_sparsity(cfg, positions)`; 0.0 for dense; None when
            the method does not report it
  n         samples behind the value (prompts or windows)
  variant   ppl: "decode" or "prefill" (see eval/ppl.py); passkey: "generate" (the method's prefill of the
            prompt, then its decode of the answer, as `jsparse generate` runs it)
  depth     passkey: the needle depth of a per-depth record, None for the record over all depths; ppl: None
  seconds   wall time of this (method, task, variant, length), compilation included

Speed: prompts and windows are built once per length and shared by every method; samples are batched
(`max_batch_tokens` tokens per forward, the last batch padded by repeating rows so one (method, length)
compiles once); compiled functions are module-level `jax.jit`s reused across samples and batches.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from eval import passkey as passkey_task
from eval import ppl as ppl_task
from models.generate import Sampling, check_request, generate_tokens

TASKS = ("passkey", "ppl")
RECORD_KEYS = ("task", "method", "length", "budget", "metric", "value", "sparsity", "n", "variant", "depth",
               "seconds")


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


def parse_artifacts(values: Sequence[str] | None, methods: Sequence[str]) -> dict[str, str]:
    """Artifact folders per method from `--artifact` values: 'DIR' (every method) or 'NAME=DIR' (one).

    Values may be repeated or comma-separated; a NAME=DIR entry wins over a plain DIR for its method.
    """
    common, per = None, {}
    for value in values or ():
        for item in parse_list(value, "--artifact"):
            name, sep, path = item.partition("=")
            if sep and name in methods:
                per[name] = path
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
    out.update(per)
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
      depths: passkey needle depths; ppl_variants: subset of ("decode", "prefill").
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
    ppl_variants: tuple[str, ...] = ppl_task.VARIANTS
    new_tokens: int = 8
    chunk: int = 512
    max_batch_tokens: int = 8192

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
        ppl_task.check_variants(self.ppl_variants)
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


def make_record(**fields) -> dict:
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


def run_passkey(model, method, prompts: Sequence[passkey_task.PasskeyPrompt], new_tokens: int, rows: int,
                tick: Callable[[], None] = lambda: None) -> list[str]:
    """Greedy completions (text) of the prompts, `rows` prompts per generate call."""
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
        tick()
    return completions


def run_ppl(model, method, windows: np.ndarray, variant: str, rows: int, chunk: int,
            tick: Callable[[], None] = lambda: None) -> np.ndarray:
    """f32[n, T - 1] token NLLs of the windows under `variant` ("decode" or "prefill")."""
    out = []
    for batch, valid in _batches(windows, rows):
        if variant == "decode":
            nll = ppl_task.decode_nll(model.params, model.cfg, method, batch, chunk=chunk, on_chunk=tick)
        else:
            nll = np.asarray(ppl_task.prefill_nll(model.params, method, jnp.asarray(batch), cfg=model.cfg))
            tick()
        out.append(nll[:valid])
    return np.concatenate(out)


def _calls(spec: EvalSpec) -> int:
    """Forward calls of the whole run (the progress bar's total)."""
    total = 0
    for length in spec.lengths:
        batches = -(-spec.samples // spec.batch_rows(length))
        per_method = 0
        if "passkey" in spec.tasks:
            per_method += batches
        if "ppl" in spec.tasks:
            for v in spec.ppl_variants:
                per_method += batches * (-(-length // spec.chunk) if v == "decode" else 1)
        total += per_method * len(spec.methods)
    return total


def build_methods(model, spec: EvalSpec) -> dict:
    """Builds every method of the run (before any work, so a bad artifact fails fast)."""
    import jsparse

    methods = {}
    for name in spec.methods:
        options = {"budget": spec.budget}
        if spec.artifacts.get(name):
            options["artifact"] = spec.artifacts[name]
        methods[name] = jsparse.build_method(name, model, **options)
    return methods


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
    if "ppl" in spec.tasks:
        corpus_ids = ppl_task.tokenize_corpus(model.tokenizer, ppl_task.read_corpus(spec.corpus))
    methods = build_methods(model, spec)

    records: list[dict] = []
    outputs: list[dict] = []
    bar = tqdm(total=_calls(spec), disable=not progress, unit="call", dynamic_ncols=True)
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
                prompts = passkey_task.make_prompts(model.tokenizer, length, spec.samples, spec.seed, spec.depths)
            if "ppl" in spec.tasks:
                windows = ppl_task.make_windows(model.tokenizer, corpus_ids, length, spec.samples, spec.seed)
            for name, method in methods.items():
                sparsity = achieved_sparsity(method, name, cfg, length)
                common = dict(method=name, length=length, budget=spec.budget, sparsity=sparsity)
                for task in spec.tasks:
                    if task == "passkey":
                        bar.set_description(f"{name} passkey {length}")
                        t0 = time.perf_counter()
                        completions = run_passkey(model, method, prompts, spec.new_tokens, rows, tick)
                        seconds = time.perf_counter() - t0
                        correct = [passkey_task.is_correct(c, p.key) for p, c in zip(prompts, completions)]
                        for p, c, ok in zip(prompts, completions, correct):
                            outputs.append(dict(method=name, length=length, depth=p.depth, key=p.key,
                                                completion=c, correct=ok))
                        new = [make_record(task="passkey", metric="accuracy", value=float(np.mean(correct)),
                                           n=len(correct), variant="generate", depth=None, seconds=seconds,
                                           **common)]
                        for depth in spec.depths:
                            hits = [ok for p, ok in zip(prompts, correct) if p.depth == depth]
                            if hits:
                                new.append(make_record(task="passkey", metric="accuracy",
                                                       value=float(np.mean(hits)), n=len(hits),
                                                       variant="generate", depth=depth, seconds=None, **common))
                        emit(new)
                    else:
                        for variant in spec.ppl_variants:
                            bar.set_description(f"{name} ppl-{variant} {length}")
                            t0 = time.perf_counter()
                            nll = run_ppl(model, method, windows, variant, rows, spec.chunk, tick)
                            seconds = time.perf_counter() - t0
                            emit([make_record(task="ppl", metric="perplexity", value=ppl_task.perplexity(nll),
                                              n=len(nll), variant=variant, depth=None, seconds=seconds,
                                              **common)])
    finally:
        bar.close()
    return EvalRun(records=records, passkey_outputs=outputs)
