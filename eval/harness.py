"""The evaluation harness: every (method, budget, task, length) of a run, as a list of flat records.

    from eval.harness import EvalSpec, evaluate
    run = evaluate(model, EvalSpec(methods=("dense", "kascade"), tasks=("passkey", "niah_single_number", "ppl"),
                                   lengths=(2048,), budgets=(0.05, 0.1, 0.2),
                                   artifacts={"kascade": "artifacts/kascade"}))
    run.records  # [{task, method, length, budget, budget_tokens, metric, value, sparsity, layer_sparsity, n,
                 #   variant, depth, seconds, acceptance_rate}, ...]

Tasks: the built-in "passkey" (eval/passkey.py) and "ppl" (eval/ppl.py), and every generation task registered in
eval/tasks (RULER-style needles, variable tracking, word extraction, co-reference, ...): its seeded prompts,
the method's prefill then its greedy decode of the task's `max_new_tokens`, scored with the task's metric. With
a draft (`EvalSpec.draft`) passkey and the generation tasks decode by greedy speculative decoding instead (the
same completions for an exact method; STS selects the target's keys from the draft's attention).

A record (every record has exactly the keys of `RECORD_KEYS`; results.json schema version `SCHEMA_VERSION`):
  task      "passkey", "ppl" or a generation task's name (eval/tasks)
  method    the method's registry name
  length    the prompt / window length in tokens (requested: a generation task's prompts hit it within 1%)
  budget    the budget fraction the method was built with, in (0, 1] (with a token budget, budget_tokens /
            visible tokens); None for a method that takes no budget (dense, tsa)
  budget_tokens
            the fixed token budget N of this record (`EvalSpec.budget_tokens`): every query attends to
            k = min(N, p + 1) keys (p its position); None when the fraction rule was used or the method takes
            no budget (dense, tsa)
  metric    "accuracy" (passkey: exact match of the key's digits), the generation task's metric
            ("string_match_all": fraction of the answers found in the completion; "string_match_part": 1 when
            any is), or "perplexity"
  value     the metric's value: a mean over the samples; for perplexity exp(mean NLL) over every scored token of
            every window pooled (not a mean of the windows' perplexities)
  sparsity  achieved sparsity: fraction of visible keys not attended, averaged over layers and the query
            positions the record scores, from `method.achieved_sparsity(cfg, positions)` (`achieved_sparsity`):
            the rows whose predictions it scores: ppl "decode" rows 0..length-2; ppl "continuation" the C rows
            before the last (the prefill's last row, then C - 1 decoded); ppl "prefill" rows 0..length-2 and
            passkey and the generation tasks the prompt's rows, in the method's prefill, 0.0 for the decode
            methods whose prefill is dense (Quest, H2O, EvoSparse, TokenButler; before 2026-12-03 these records
            carried the decode rule over 0..length-1; before 2026-12-04 ppl counted rows 1..length-1, one off);
            0.0 for dense; None when the method does not report it. For a method
            that measures its prefill (TSA, see layer_sparsity),
            the measured attention-map sparsity of the record's prefills averaged over all layers (dense
            layers count 0)
  layer_sparsity
            {layer (str): attention-map sparsity} of each sparse layer, measured on the record's prefills and
            averaged over the samples, for methods with `prefill_layer_sparsity` (TSA: the fraction of the
            causal attention map its compression skips, the paper's Table 3; tsa+kascade: with Kascade's top-k among
            the kept tokens, every layer either makes sparse); None otherwise (and for the ppl
            "decode" variant, which runs no prefill)
  n         samples behind the value (prompts or windows)
  variant   ppl: "decode", "prefill" or "continuation" (see eval/ppl.py); passkey: "generate" (the method's
            prefill of the prompt, then its decode of the answer, as `jsparse generate` runs it); a generation
            task: "generate" (raw completion) or "chat" (the prompt in the model's chat template)
  depth     passkey and the needle tasks: the needle depth of a per-depth record, None for the record over all
            depths; otherwise None
  seconds   wall time of this (method, budget, task, variant, length), compilation included; passkey and the
            generation tasks of one (method, budget, length) run in shared generate calls, whose time each of
            them gets in proportion to its prompts
  acceptance_rate
            passkey and the generation tasks with a draft (`EvalSpec.draft`, greedy speculative decoding):
            accepted draft tokens / proposed ones over the rounds of the record's prompts (each prompt's row
            stops at its task's token count; a per-depth record: its depth's prompts); None otherwise (ppl, no
            draft)

A per-depth record carries its own value, n and acceptance rate, the sparsity of the record over all depths, and
no layer_sparsity (measured over all depths' prefills together). With a draft, a method that measures its prefill
(TSA, tsa+kascade) reports no sparsity on passkey and the generation tasks (speculative decoding does not hand back
the prefill's state).

A record's unit (`record_key`: method, budget, budget_tokens, task, length, variant) is what a resumed run skips.

Speed: prompts and windows are built once per length and shared by every method and budget; samples are
batched (`max_batch_tokens` tokens per forward, the last batch padded by repeating rows so one (method, length)
compiles once); the prompts of passkey and of every generation task of a length pad to one width and one
decode length and run together, `max_batch_tokens` tokens per generate call, so a method compiles one generate
per length and runs as few decode loops as the batches allow; the ppl "continuation" variant runs its prefill
and its decode as one compiled function (when C <= `chunk`); compiled functions are module-level `jax.jit`s
reused across samples and batches.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
import warnings
from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from eval import passkey as passkey_task
from eval import ppl as ppl_task
from jsparse.api import eos_ids
from models.generate import Sampling, check_request, generate_tokens
from models.compile_options import model_jit

TASKS = ("passkey", "ppl")  # the built-in tasks; generation_tasks() adds eval/tasks' registry
SCHEMA_VERSION = 2  # of results.json (see eval/report.py); bump it when RECORD_KEYS or a key's meaning changes
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


def generation_tasks() -> dict:
    """The generation tasks of eval/tasks (name -> Task) the harness runs by prefill + greedy decode, all but
    passkey (its built-in path, eval/passkey.py, keeps its per-depth records and haystacks)."""
    from eval import tasks as task_registry

    return {name: task for name, task in task_registry.TASKS.items() if name not in TASKS}


def task_names() -> tuple[str, ...]:
    """Every task `jsparse eval --tasks` accepts: passkey, ppl, then the generation tasks."""
    return TASKS + tuple(generation_tasks())


def check_tasks(tasks: Sequence[str]) -> tuple[str, ...]:
    valid = task_names()
    for t in tasks:
        if t not in valid:
            raise ValueError(f"unknown task {t!r}; valid tasks: {', '.join(valid)}")
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
    if len(set(out)) != len(out):
        raise ValueError(f"lengths {out} name a length twice")
    return tuple(out)


def components(method: str) -> tuple[str, ...]:
    """The component methods of a composed method name ('tsa+kascade' -> ('tsa', 'kascade')); () otherwise."""
    parts = tuple(method.split("+"))
    return parts if len(parts) > 1 else ()


def parse_artifacts(values: Sequence[str] | None, methods: Sequence[str]) -> dict[str, str]:
    """Artifact folders per method from `--artifact` values: 'DIR' (every method that reads an artifact,
    `takes_artifact`) or 'NAME=DIR' (one).

    Values may be repeated or comma-separated; a NAME=DIR entry wins over a plain DIR for its method. NAME may
    also be a component of a composed method: `--artifact kascade=K --artifact tsa=T` gives `--methods
    tsa+kascade` the folders 'K' + os.pathsep + 'T' (the composed builder routes each by its kind), unless a
    'tsa+kascade=...' entry names the composed method itself.

    Raises ValueError for a NAME given two different folders, and for a plain DIR when no method of `methods` reads
    an artifact (it would go nowhere).
    """
    import os

    from jsparse.methods.base import takes_artifact

    common, per, parts = None, {}, {}
    used = {c for m in methods for c in components(m)}
    for value in values or ():
        for item in parse_list(value, "--artifact"):
            name, sep, path = item.partition("=")
            if sep and (name in methods or name in used):
                if per.get(name, path) != path or parts.get(name, path) != path:
                    raise ValueError(f"--artifact gives method {name!r} two folders "
                                     f"({per.get(name, parts.get(name))!r} and {path!r}): expected one")
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
    out = {m: common for m in methods if common is not None and takes_artifact(m)}  # a plain DIR: those reading one
    if common is not None and not out:
        raise ValueError(f"--artifact {common!r}: no method of --methods {','.join(methods)} reads an artifact "
                         "(expected NAME=DIR for a method that does, or no --artifact)")
    for m in methods:
        given = [parts[c] for c in components(m) if c in parts]
        if given:
            out[m] = os.pathsep.join(given)
    out.update(per)
    return out


def parse_budget_tokens(text: str | Sequence[int] | None) -> tuple[int, ...] | None:
    """'256,512' -> (256, 512): fixed token budgets (positive integers); None -> None (the fraction rule). An empty
    string is an error (a shell variable that expanded to nothing would otherwise fall back to the fraction rule)."""
    if text is None:
        return None
    if isinstance(text, str) and not text.strip():
        raise ValueError(f"--budget-tokens {text!r}: expected token budgets N[,N...], e.g. 256,512")
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


def parse_budgets(text: str | Sequence[float] | None) -> tuple[float, ...] | None:
    """'0.05,0.1,0.2' -> (0.05, 0.1, 0.2): budget fractions in (0, 1], each once; None -> None; an empty string is
    an error (not the default budget)."""
    if text is None:
        return None
    if isinstance(text, str) and not text.strip():
        raise ValueError(f"--budgets {text!r}: expected budget fractions F[,F...] in (0, 1], e.g. 0.05,0.1")
    items = parse_list(text, "--budgets") if isinstance(text, str) else tuple(text)
    out = []
    for i in items:
        try:
            b = float(i)
        except (TypeError, ValueError):
            raise ValueError(f"budget {i!r}: expected a fraction of the context in (0, 1] (token budgets go to "
                             "--budget-tokens)") from None
        if not 0.0 < b <= 1.0:
            raise ValueError(f"budget {i!r}: expected a fraction of the context in (0, 1] (token budgets go to "
                             "--budget-tokens)")
        out.append(b)
    if len(set(out)) != len(out):
        raise ValueError(f"--budgets {list(out)} names a budget twice")
    return tuple(out)


def _option_value(text: str):
    import json

    try:
        return json.loads(text)
    except ValueError:
        return text


def _split_options(text: str) -> list[str]:
    """'a.x=1,b.y=[3, 4]' -> ['a.x=1', 'b.y=[3, 4]']: commas inside brackets, braces or quotes belong to a value."""
    items, depth, quote, start = [], 0, None, 0
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    return items + [text[start:]]


# Method options that are the run's budget, and the flags that set it.
BUDGET_FLAGS = {"budget": "--budget (jsparse generate) or --budgets (jsparse eval)",
                "budget_tokens": "--budget-tokens"}
# Builder options the run gives a method from its own flags (`build_method`), and those flags.
RUN_SETS = {"artifact": "--artifact (EvalSpec.artifacts)", "draft": "--draft (EvalSpec.draft)"}
# Builder options a token budget sets itself (`token_budget_options`: N keys in every layer).
TOKEN_BUDGET_SETS = ("min_tokens", "reuse_scale")


def refuse_budget_option(what: str, field: str, setters: str = "") -> None:
    """Raises ValueError when method option `field` (given as `what`) is the run's budget, which its flags set
    (`BUDGET_FLAGS`, then `setters`)."""
    if field in BUDGET_FLAGS:
        raise ValueError(f"{what}: the budget is set by {BUDGET_FLAGS[field]}{setters}, not by a method option (a run "
                         "records the budget it gives every method)")


def parse_method_options(values: Sequence[str] | None, methods: Sequence[str],
                         methods_flag: str = "--methods") -> dict[str, dict]:
    """`--method-option NAME.KEY=VALUE` values (repeatable, comma-separated) -> {NAME: {KEY: VALUE}}.

    VALUE is read as JSON when it parses (0.01, 3, true, [3, 4]) and as a string otherwise; NAME must be one of
    `methods` (the command's `methods_flag`, named in the error). Each option is a keyword of the method's builder
    (e.g. tsa.tau=0.01).
    """
    out: dict[str, dict] = {}
    for value in values or ():
        for item in parse_list(_split_options(value), "--method-option"):
            key, sep, raw = item.partition("=")
            name, dot, field = key.rpartition(".")
            if not sep or not dot or not name or not field:
                raise ValueError(f"--method-option {item!r}: expected METHOD.OPTION=VALUE, e.g. tsa.tau=0.01 (a list "
                                 "value in brackets: tsa.sparse_layers=[1,2])")
            if name not in methods:
                raise ValueError(f"--method-option {item!r} names method {name!r}, which is not in {methods_flag} "
                                 f"{','.join(methods)}")
            refuse_budget_option(f"--method-option {item!r}", field)
            options = out.setdefault(name, {})
            if field in options:
                raise ValueError(f"--method-option {name}.{field} given twice ({options[field]!r}, then {raw}): "
                                 "expected it once")
            options[field] = _option_value(raw)
    return out


@dataclasses.dataclass(frozen=True)
class EvalSpec:
    """What one evaluation run measures.

    Attributes:
      methods: registry names of the methods; tasks: subset of TASKS and the generation tasks of eval/tasks;
        lengths: prompt lengths in tokens.
      budget: the budget every sparse method is built with, in (0, 1] (when `budgets` is None).
      budgets: budget fractions to sweep, each in (0, 1]: every method that takes a budget runs once per fraction
        (and once per token budget of `budget_tokens`); None: `budget` alone, or only `budget_tokens` when those
        are given. Methods without a budget (dense, tsa) run once per length, their records' budget None.
      samples: passkey prompts / generation-task prompts (and ppl windows, unless `ppl_samples`) per length
        (passkey depths cycle over the samples: sample i has depth depths[i % len(depths)]).
      ppl_samples: ppl windows per length; None: `samples`.
      seed: seeds the passkey keys and filler, the generation tasks' samples and the ppl window offsets.
      corpus: the ppl corpus (a UTF-8 text file); artifacts: method name -> artifact folder.
      depths: passkey needle depths (the needle tasks of eval/tasks cycle their own 0.1..0.9); ppl_variants: subset
        of ("decode", "prefill", "continuation").
      haystack: the filler of passkey and the generation tasks, "repeat" (the classic sentences) or "corpus"
        (stretches of `corpus`).
      continuation: C, the scored tokens of the ppl "continuation" variant (the prompt is the rest).
      budget_tokens: fixed token budgets N, or None for the fraction rule (`budget`). Each N runs every method
        that takes a budget with k = min(N, p + 1) keys per query at position p: TokenBudget methods (and
        compositions around one) get min_tokens = N and a budget small enough that the fraction never exceeds N
        at the longest position the run reaches (the prompt plus the most new tokens of its tasks; the length
        for a ppl-only run), methods with a
        `budget_tokens` field (EvoSparse) get budget_tokens = N; methods without a budget (dense, tsa) run once
        per length.
      method_options: method name -> extra keyword options of its builder (e.g. {"tsa": {"tau": 0.01}}); not its
        budget, artifact or draft, which `budget(s)` / `budget_tokens`, `artifacts` and `draft` give.
      new_tokens: tokens generated greedily for a passkey answer (a generation task of eval/tasks generates its
        own `max_new_tokens`).
      chat: the generation tasks' prompts in the model's chat template (variant "chat") instead of raw
        completions (variant "generate"); passkey and ppl are always raw.
      chunk: tokens per decode call in the ppl "decode" and "continuation" variants (the continuation runs as one
        call when C <= chunk).
      max_batch_tokens: rows per forward = max(1, max_batch_tokens // length).
      draft: a draft model (a LoadedModel with the target's vocabulary) or None. With one, passkey and every
        generation task answer by greedy speculative decoding (`gamma` draft tokens per round; their records
        carry the acceptance rate), and STS (which needs it) takes its selection from the draft's attention;
        ppl runs STS as the "prefill" (STS-P) and "continuation" (STS-D) variants, the other methods as without.
      gamma: draft tokens proposed per round with `draft`.
      allow_calibration_corpus: run even when `corpus` (ppl, or the "corpus" haystack) is the text an artifact of
        the run was calibrated or trained on (`check_calibration_corpus`; an error otherwise).
    """

    methods: tuple[str, ...]
    tasks: tuple[str, ...] = TASKS
    lengths: tuple[int, ...] = (2048, 4096)
    budget: float = 0.1
    samples: int = 10
    ppl_samples: int | None = None
    seed: int = 0
    corpus: str | None = ppl_task.DEFAULT_CORPUS
    artifacts: Mapping[str, str] = dataclasses.field(default_factory=dict)
    depths: tuple[float, ...] = passkey_task.DEFAULT_DEPTHS
    haystack: str = "repeat"
    ppl_variants: tuple[str, ...] = ppl_task.DEFAULT_VARIANTS
    continuation: int = ppl_task.DEFAULT_CONTINUATION
    budget_tokens: tuple[int, ...] | None = None
    budgets: tuple[float, ...] | None = None
    chat: bool = False
    method_options: Mapping[str, Mapping] = dataclasses.field(default_factory=dict)
    new_tokens: int = 8
    chunk: int = 512
    max_batch_tokens: int = 8192
    draft: object = None
    gamma: int = 4
    allow_calibration_corpus: bool = False

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
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed={self.seed!r}: expected an integer >= 0")
        if self.ppl_samples is not None and (not isinstance(self.ppl_samples, int) or self.ppl_samples < 1):
            raise ValueError(f"ppl_samples={self.ppl_samples!r}: expected a positive integer (ppl windows per length)")
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
        elif isinstance(self.continuation, bool) or not isinstance(self.continuation, int) or self.continuation < 1:
            # unused by this run, but recorded in its resume config
            raise ValueError(f"continuation={self.continuation!r} tokens (--continuation-tokens): expected an integer "
                             ">= 1")
        if self.budget_tokens is not None:
            parse_budget_tokens(self.budget_tokens)
            if "sts" in self.methods:
                for tokens in self.budget_tokens:
                    check_sts_token_budget(tokens)
        if self.budgets is not None:
            parse_budgets(self.budgets)
        for name, options in self.method_options.items():
            if name not in self.methods:
                raise ValueError(f"method options given for method {name!r}, which is not among the methods "
                                 f"{list(self.methods)}")
            for field in options:
                refuse_budget_option(f"method option {name}.{field}={options[field]!r}", field,
                                     " (EvalSpec.budget / budgets / budget_tokens)")
                if field in RUN_SETS:  # the run's value would be replaced by the option's, unrecorded
                    raise ValueError(f"--method-option {name}.{field}={options[field]!r}: the {field} is given by "
                                     f"{RUN_SETS[field]}")
            check_method_options(None, name, options)  # the options a method's class shows: before any model loads
            for key in TOKEN_BUDGET_SETS:
                if key not in options or self.budget_tokens is None:
                    continue
                message = (f"method option {name}.{key}={options[key]!r} with token budgets "
                           f"{list(self.budget_tokens)} (--budget-tokens): a token budget N sets {key} itself "
                           "(N keys in every layer)")
                if not self.fractions():
                    raise ValueError(message + "; this run has no fraction budget the option could apply to")
                warnings.warn(message + f", so the option applies to the fraction runs {list(self.fractions())} "
                              "only", stacklevel=2)
        for name in self.artifacts:
            if name not in self.methods:
                raise ValueError(f"artifact given for method {name!r}, which is not among the methods "
                                 f"{list(self.methods)}")
        return self

    def ppl_windows(self) -> int:
        """ppl windows per length: `ppl_samples`, else `samples`."""
        return self.samples if self.ppl_samples is None else self.ppl_samples

    def ppl_rows(self, length: int) -> int:
        return max(1, min(self.ppl_windows(), self.max_batch_tokens // length))

    def generation_rows(self, length: int, prompts: int) -> int:
        """Rows per generate call for `prompts` prompts of one (method, length) (passkey and every generation task
        together): at most max_batch_tokens // length, balanced so that the last batch is as full as the others."""
        most = max(1, self.max_batch_tokens // length)
        calls = -(-max(prompts, 1) // most)
        return -(-max(prompts, 1) // calls)

    def fractions(self) -> tuple[float, ...]:
        """The budget fractions every budgeted method runs at: `budgets`, else (`budget`,) unless only token
        budgets are given."""
        if self.budgets is not None:
            return tuple(self.budgets)
        return () if self.budget_tokens is not None else (self.budget,)

    def base_budget(self) -> float:
        """The budget each method's base instance is built at (`build_methods`): the first fraction the run uses,
        or 1.0 when it runs token budgets only (any budgeted method builds at 1.0: a build at a default the run
        never uses could fail, e.g. TokenButler's calibrated dense layers need a budget above theirs)."""
        fractions = self.fractions()
        return fractions[0] if fractions else 1.0

    def generation_variant(self) -> str:
        return "chat" if self.chat else "generate"


@dataclasses.dataclass
class EvalRun:
    """records: the flat records (see the module docstring); outputs: one dict per sample of passkey and the
    generation tasks (task, method, budget, budget_tokens, length, depth, answers, completion, score) for
    reading failures; ppl_overlap: {length: (ppl windows, non-overlapping windows the corpus holds)} at the lengths
    where the perplexity windows overlap (they share text, so n counts fewer distinct tokens)."""

    records: list[dict]
    outputs: list[dict]
    ppl_overlap: dict = dataclasses.field(default_factory=dict)


OPTIONAL_KEYS = {"budget_tokens": None, "layer_sparsity": None, "acceptance_rate": None}  # None when not given


def make_record(**fields) -> dict:
    fields = {**OPTIONAL_KEYS, **fields}
    missing = [k for k in RECORD_KEYS if k not in fields] + [k for k in fields if k not in RECORD_KEYS]
    if missing:
        raise KeyError(f"record keys {missing} do not match {RECORD_KEYS}")
    return {k: fields[k] for k in RECORD_KEYS}


def achieved_sparsity(method, name: str, cfg, length: int, variant: str = "decode",
                      continuation: int | None = None) -> float | None:
    """The method's achieved sparsity over the query rows whose outputs a record of `variant` scores, each by the
    rule of the phase that computes it (0.0 for dense, None if unreported). A row at position p predicts token
    p + 1, so ppl scores rows 0..length-2 (the last row predicts nothing):
      "decode" (ppl): rows 0..length-2, all decoded;
      "continuation" (ppl): rows length-C-1..length-2: the first is the prefill's last row, the other C - 1 are
        decoded after it (the mean over the C rows);
      "prefill" (ppl): rows 0..length-2 of the method's prefill; "generate" / "chat" (passkey and the generation
        tasks): the prompt's rows 0..length-1 in the method's prefill (its last row gives the first new token).
    A prefill row is 0.0 for a method whose prefill attends to every key (`dense_prefill`: Quest, H2O, EvoSparse,
    TokenButler), else the method's rule over it (the decode rule, k(p + 1) keys at position p: for the tile-based
    prefills, which also attend each query's own tile, an upper bound of the skipped fraction)."""
    fn = getattr(method, "achieved_sparsity", None)
    if fn is None:
        return 0.0 if name == "dense" else None
    dense_prefill = getattr(method, "dense_prefill", False)

    def rule(positions):
        return float(fn(cfg, np.asarray(positions, np.int32)))
    if variant == "continuation":
        if continuation is None:
            raise ValueError("variant 'continuation' needs its continuation tokens")
        first = length - continuation - 1  # the prefill's last row
        head = 0.0 if dense_prefill else rule([first])
        rest = rule(np.arange(first + 1, length - 1)) if continuation > 1 else 0.0
        return (head + (continuation - 1) * rest) / continuation
    if variant == "decode":
        return rule(np.arange(length - 1))
    if dense_prefill:
        return 0.0
    return rule(np.arange(length - 1 if variant == "prefill" else length))


def _batches(rows: np.ndarray, size: int):
    """Yields (batch i32[size, T], valid rows) with the last batch padded by repeating its last row."""
    for s in range(0, len(rows), size):
        part = rows[s:s + size]
        valid = len(part)
        if valid < size:
            part = np.concatenate([part, np.repeat(part[-1:], size - valid, axis=0)])
        yield part, valid


class LayerSparsity:
    """Accumulates a method's measured prefill sparsity per layer over the samples (valid rows only)."""

    def __init__(self, method, cfg):
        self.fn = getattr(method, "prefill_layer_sparsity", None)
        self.cfg = cfg
        self.rows: dict[int, list] = {}

    @property
    def active(self) -> bool:
        return self.fn is not None

    def add(self, state, lengths, valid: int, rows: Sequence[int] | None = None) -> None:
        """Adds the prefill of one batch: its rows 0..valid-1, or the batch rows `rows` (indices < valid)."""
        if self.fn is None:
            return
        keep = np.arange(valid) if rows is None else np.asarray(rows, np.int64)
        for layer, values in self.fn(self.cfg, state, np.asarray(lengths)).items():
            self.rows.setdefault(int(layer), []).extend(np.asarray(values, np.float64)[keep].tolist())

    def result(self) -> tuple[dict | None, float | None]:
        """({layer (str): mean over samples}, mean over all layers with dense layers as 0), or (None, None)."""
        if not self.rows:
            return None, None
        per = {str(layer): float(np.mean(v)) for layer, v in sorted(self.rows.items())}
        return per, float(sum(per.values()) / self.cfg.num_layers)


def run_generation(model, method, prompts: Sequence[Sequence[int]], new_tokens: int | Sequence[int], rows: int,
                   tick: Callable[[], None] = lambda: None,
                   layer_sparsity: LayerSparsity | Sequence[LayerSparsity] | None = None, *,
                   width: int | None = None, max_new_tokens: int | None = None, draft=None, gamma: int = 4,
                   stats: dict | None = None) -> list[str]:
    """Greedy completions (text, `new_tokens` tokens at most) of token prompts of any lengths: the method's
    prefill of each prompt, then its decode, `rows` prompts per generate call (the last batch padded by repeating
    its last row), prompts right-padded to `width` tokens (default: the longest prompt).

    `new_tokens` is one count for every prompt or one per prompt (prompts of several tasks in one batch).
    `width` and `max_new_tokens` (>= every new_tokens, default the largest) fix the compiled shape, so that every
    task of a length shares one compilation per method; a completion is cut to its first `new_tokens` tokens,
    which greedy decoding makes the same as generating `new_tokens`. Given `layer_sparsity` (one, or one per
    prompt) of a method that measures its prefill, the generate call returns the state of its own prefill for it
    (no second prefill); each prompt's row goes to its own accumulator.

    With `draft`: greedy speculative decoding (`models.speculative.speculative_generate`, `gamma` draft tokens
    per round; the same completions as without a draft, up to the method; STS takes its selection from the
    draft), each row stopping at its own `new_tokens`; `stats` then receives `rounds` and `accepted` (lists, one
    per prompt: the rounds the prompt's row took part in and the draft tokens accepted over them) and `gamma`.
    The prefill is not measured with a draft (`layer_sparsity` stays empty).
    """
    lengths_all = np.asarray([len(p) for p in prompts], np.int32)
    per_new = np.broadcast_to(np.asarray(new_tokens, np.int64), (len(prompts),))
    width = int(lengths_all.max()) if width is None else int(width)
    steps = int(per_new.max()) if max_new_tokens is None else int(max_new_tokens)
    if width < lengths_all.max() or steps < per_new.max():
        raise ValueError(f"width={width}, max_new_tokens={steps}: expected >= the longest prompt "
                         f"({lengths_all.max()}) and new_tokens={int(per_new.max())}")
    trackers = list(layer_sparsity) if isinstance(layer_sparsity, (list, tuple)) else \
        [layer_sparsity] * len(prompts)
    if len(trackers) != len(prompts):
        raise ValueError(f"{len(trackers)} layer_sparsity accumulators for {len(prompts)} prompts: expected one, "
                         "or one per prompt")
    if draft is None:
        capacity = check_request(model.cfg, [width], steps)
    else:
        from jsparse.api import check_draft, check_draft_context, speculative_methods
        from models.speculative import speculative_generate

        check_draft(model, draft, gamma)
        check_draft_context(draft, [width], steps)
        # The verification writes up to gamma + 1 rows past the accepted tokens.
        capacity = check_request(model.cfg, [width], steps, verify_rows=gamma + 1)
        t_method, d_method = speculative_methods(method, model, draft, gamma)
    eos = eos_ids(model)
    tokens = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = np.asarray(p, np.int32)
    completions, rounds, accepted = [], [], []
    measure = draft is None and any(t is not None and t.active for t in trackers)
    for start, ((batch, valid), (lengths, _), (cuts, _)) in enumerate(
            zip(_batches(tokens, rows), _batches(lengths_all, rows), _batches(np.asarray(per_new, np.int32), rows))):
        start *= rows
        lengths = jnp.asarray(lengths)
        if draft is None:
            out, num, *state = generate_tokens(model.params, method, jnp.asarray(batch), lengths, jax.random.key(0),
                                               cfg=model.cfg, max_new_tokens=steps, capacity=capacity,
                                               sampling=Sampling(), eos_ids=eos, return_prefill_state=measure)
        else:
            out, num, r, a = speculative_generate(
                model.params, draft.params, t_method, d_method, jnp.asarray(batch), lengths, jax.random.key(0),
                t_cfg=model.cfg, d_cfg=draft.cfg, gamma=gamma, max_new_tokens=steps, capacity=capacity,
                sampling=Sampling(), eos_ids=eos, row_new_tokens=jnp.asarray(cuts))
            rounds += np.asarray(r)[:valid].tolist()
            accepted += np.asarray(a)[:valid].tolist()
        out, num = np.asarray(out), np.asarray(num)
        for row, n, cut in zip(out[:valid], num[:valid], cuts[:valid]):
            ids = [int(t) for t in row[:min(n, cut)] if t >= 0 and int(t) not in eos]
            completions.append(model.tokenizer.decode(ids, skip_special_tokens=True))
        if measure:
            groups: dict[int, tuple] = {}
            for i in range(valid):
                tracker = trackers[start + i]
                if tracker is not None and tracker.active:
                    groups.setdefault(id(tracker), (tracker, []))[1].append(i)
            for tracker, idx in groups.values():
                tracker.add(state[0], lengths, valid, rows=idx)
        tick()
    if draft is not None and stats is not None:
        stats.update(rounds=rounds, accepted=accepted, gamma=gamma)
    return completions


def acceptance_rate(stats: Mapping, prompts: Sequence[int] | None = None) -> float | None:
    """Accepted draft tokens / proposed ones (gamma per round) over the prompts `prompts` (indices; None: all)
    of `run_generation`'s speculative `stats`; None without stats (no draft)."""
    if not stats:
        return None
    idx = range(len(stats["rounds"])) if prompts is None else prompts
    rounds = sum(int(stats["rounds"][i]) for i in idx)
    return sum(int(stats["accepted"][i]) for i in idx) / max(rounds * stats["gamma"], 1)


def run_passkey(model, method, prompts: Sequence[passkey_task.PasskeyPrompt], new_tokens: int, rows: int,
                tick: Callable[[], None] = lambda: None, layer_sparsity: LayerSparsity | None = None,
                draft=None, gamma: int = 4, stats: dict | None = None, *, width: int | None = None,
                max_new_tokens: int | None = None) -> list[str]:
    """Greedy completions (text) of the prompts, `rows` prompts per generate call (see `run_generation`, which
    `width`, `max_new_tokens`, `draft` and `gamma` go to). With `draft`, speculative decoding (gamma tokens per
    round; STS takes its selection from the draft); `stats` then receives `rounds` and `accepted` summed over the
    prompts, and `gamma`."""
    per_prompt: dict = {}
    completions = run_generation(model, method, [p.tokens for p in prompts], new_tokens, rows, tick, layer_sparsity,
                                 width=width, max_new_tokens=max_new_tokens, draft=draft, gamma=gamma,
                                 stats=per_prompt)
    if per_prompt and stats is not None:
        stats.update(rounds=sum(per_prompt["rounds"]), accepted=sum(per_prompt["accepted"]), gamma=gamma)
    return completions


@functools.partial(model_jit, static_argnames=("t_cfg", "d_cfg"))
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


@functools.partial(model_jit, static_argnames=("t_cfg", "d_cfg", "continuation", "gamma"))
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
    nll0 = ppl_task._token_nll(logits, tokens[:, P])  # token P from the prefill's last logits
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
        nll = ppl_task._token_nll(logits, tgt)
        d_cache = d_cache.replace(lengths=t_cache.lengths)
        return (t_cache, d_cache, t_state, d_state, chunk[:, -1]), nll

    carry = (t_cache, d_cache, t_state, d_state, tokens[:, P - 1])
    _, nll = jax.lax.scan(one_round, carry, (jnp.moveaxis(rounds, 1, 0), jnp.moveaxis(targets, 1, 0)))
    nll = jnp.moveaxis(nll, 0, 1).reshape(B, R * (g + 1))[:, :C - 1]
    return jnp.concatenate([nll0[:, None], nll], axis=1)


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


def _safe_budget(tokens: int, max_visible: int) -> float:
    """The largest budget b <= 1 with ceil(b * n) <= tokens for every n <= max_visible, in float64 and float32
    (so that with min_tokens = tokens the fraction rule gives k = min(tokens, n))."""
    if tokens >= max_visible:
        return 1.0
    b = np.float32(tokens / max_visible)
    while float(np.float32(b) * np.float32(max_visible)) > tokens or float(b) * max_visible > tokens:
        b = np.nextafter(b, np.float32(0))
    return float(b)


def check_sts_token_budget(tokens: int) -> None:
    """STS reads a budget of 1 as the fraction 1 (every key) and above 1 as a token count: --budget-tokens 1 cannot
    be given to it."""
    if tokens == 1:
        raise ValueError("--budget-tokens 1 with method 'sts': an STS budget of 1 is the fraction 1 (every key), above "
                         "1 a token count; expected token budgets >= 2 for sts")


def token_budget_options(method, tokens: int, max_visible: int) -> dict:
    """Builder options that give `method` (a built instance, or a method class that wraps no other method) the fixed
    budget k = min(tokens, p + 1) at every position p < max_visible, in every sparse layer (Kascade's reuse layers
    too: reuse_scale 1); {} for a method without a budget (dense, tsa)."""
    from jsparse.methods.common import TokenBudget

    fields = getattr(method, "__dataclass_fields__", {})
    if getattr(method, "needs_draft", False):  # STS: budgets above 1 count tokens
        check_sts_token_budget(tokens)
        return {"budget": float(tokens) if tokens < max_visible else 1.0}
    if "budget_tokens" in fields:
        return {"budget_tokens": int(tokens)}
    inner = getattr(method, "inner", None)
    own = issubclass(method, TokenBudget) if isinstance(method, type) else isinstance(method, TokenBudget)
    if own or isinstance(inner, TokenBudget):
        out = {"budget": _safe_budget(int(tokens), max_visible), "min_tokens": int(tokens)}
        # Kascade's reuse layers keep min(max(ceil(r * budget * n), min_tokens), n) keys: the fraction binds at the
        # longest lengths, so r > 1 would keep up to r * N there. N keys in every layer: r = 1.
        if "reuse_scale" in getattr(method if own else inner, "__dataclass_fields__", {}):
            out["reuse_scale"] = 1.0
        return out
    return {}


def check_method_options(method, name: str, options: Mapping) -> None:
    """--method-option keys the method (`method`, once built; else its registered options) does not take, and
    (before it is built) a value of an option its class declares bool that is not one."""
    import dataclasses

    from jsparse.methods.base import check_options, method_factory, method_options

    if method is None and not dataclasses.is_dataclass(method_factory(name)):
        return  # a builder wrapping another method: make_method checks the options of what it builds
    valid = method_options(name, method)
    for key, value in options.items():
        if key not in valid:
            raise ValueError(f"--method-option {name}.{key}={value!r}: method {name!r} has no option {key!r}; its "
                             f"options are {', '.join(v for v in valid if v not in ('cfg', 'fingerprint'))}")
    if method is None:
        check_options(name, dict(options))  # its bool options: 'False' (not JSON) is a truthy string


def check_calibration_corpus(spec: EvalSpec) -> None:
    """Refuses to score a method on its own calibration text: raises ValueError when `spec.corpus` feeds the run
    (ppl, or the "corpus" haystack) and holds the same text as a file some artifact of the run was calibrated or
    trained on (its recorded `corpus_sha256`; `jsparse.artifacts.calibrated_on`), unless
    `spec.allow_calibration_corpus`."""
    from jsparse.artifacts import calibrated_on

    reads = "ppl" in spec.tasks or (spec.haystack == "corpus" and any(t != "ppl" for t in spec.tasks))
    if spec.allow_calibration_corpus or not reads or not spec.corpus or not os.path.isfile(spec.corpus):
        return
    for name, folder in spec.artifacts.items():
        source = calibrated_on(folder, spec.corpus)
        if source is not None:
            raise ValueError(
                f"--corpus {spec.corpus!r} holds the text that the {name!r} artifact at {folder!r} was calibrated "
                f"or trained on ({source!r}): its scores would be measured on its own calibration data. Evaluate on "
                "another text (the default corpus, eval/data/call_of_the_wild.txt, is not the default calibration "
                "text), or pass --allow-calibration-corpus to measure anyway")


def generation_haystack(spec: EvalSpec) -> str:
    """The `haystack` of the generation tasks (eval/tasks): with --haystack corpus, the corpus file by its absolute
    path, so a file named "corpus" or "repeat" is read, not taken for the built-in haystack of that name."""
    return os.path.abspath(spec.corpus) if spec.haystack == "corpus" else spec.haystack


def build_method(model, spec: EvalSpec, name: str, default_budget: float | None = None, **overrides):
    """Builds one method of the run with its artifact, method options and `overrides` (budget ...); the budget is
    `default_budget` (None: `spec.budget`) unless its method options or `overrides` set one."""
    import jsparse

    options = {"budget": spec.budget if default_budget is None else default_budget}
    if name == "sts":
        options["draft"] = spec.draft
    if spec.artifacts.get(name):
        options["artifact"] = spec.artifacts[name]
    options.update(spec.method_options.get(name, {}))
    options.update(overrides)
    check_method_options(None, name, spec.method_options.get(name, {}))  # before building (wrappers: partial list)
    method = jsparse.build_method(name, model, **options)
    return method


def build_methods(model, spec: EvalSpec) -> dict:
    """Builds every method of the run (before any work, so a bad artifact fails fast), at `spec.base_budget()`."""
    return {name: build_method(model, spec, name, default_budget=spec.base_budget()) for name in spec.methods}


def takes_budget(method) -> bool:
    """Whether a built method takes a budget (a `budget` field or a token-budget option; dense and tsa do not:
    they run once per length)."""
    return "budget" in getattr(method, "__dataclass_fields__", {}) or bool(token_budget_options(method, 2, 4))


def record_key(r: Mapping) -> tuple:
    """The identity of a record's unit of work: (method, budget, budget_tokens, task, length, variant), budget
    None for a token-budget record (its fraction derives from the token budget). A resumed run skips the units
    whose keys its results.json already holds."""
    tokens = r.get("budget_tokens")
    return (r["method"], None if tokens is not None else r["budget"], tokens, r["task"], r["length"], r["variant"])


@dataclasses.dataclass(frozen=True)
class MethodRun:
    """One method at one budget: `build()` makes it (the base instance when the budget is the run's default)."""

    name: str
    budget: float | None
    budget_tokens: int | None
    build: Callable[[], object]

    @property
    def label(self) -> str:
        if self.budget_tokens is not None:
            return f"{self.name} k={self.budget_tokens}"
        return self.name if self.budget is None else f"{self.name} b={self.budget:g}"


def method_runs(model, spec: EvalSpec, methods: Mapping, max_visible: int) -> list[MethodRun]:
    """Every (method, budget) of one length: each method that takes a budget once per fraction of
    `spec.fractions()` and once per token budget of `spec.budget_tokens` (k = min(N, p + 1) keys per query at
    every position p < max_visible); a method without a budget (dense, tsa) once, with budget None."""
    out = []
    for name, method in methods.items():
        if not takes_budget(method):
            out.append(MethodRun(name, None, None, lambda m=method: m))
            continue
        for b in spec.fractions():
            build = (lambda m=method: m) if b == spec.base_budget() else \
                (lambda n=name, b=b: build_method(model, spec, n, budget=b))
            out.append(MethodRun(name, b, None, build))
        for tokens in spec.budget_tokens or ():
            options = token_budget_options(method, tokens, max_visible)
            if not options:
                continue  # a fraction-only budget: no fixed token budget to give it
            # The record's budget is a fraction in (0, 1]; STS's builder option counts tokens above 1.
            fraction = options.get("budget", 2.0)
            if fraction > 1.0:
                fraction = min(1.0, tokens / max_visible)
            out.append(MethodRun(name, fraction, int(tokens),
                                 lambda n=name, o=options: build_method(model, spec, n, **o)))
    return out


def _units(spec: EvalSpec) -> list[tuple[str, str]]:
    """The (task, variant) units every (method, budget, length) runs."""
    units = []
    for task in spec.tasks:
        if task == "passkey":
            units.append(("passkey", "generate"))
        elif task == "ppl":
            units += [("ppl", v) for v in spec.ppl_variants]
        else:
            units.append((task, spec.generation_variant()))
    return units


def _generation_units(spec: EvalSpec, todo: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """The units of `todo` whose prompts run together in shared generate calls (speculative decoding ones with a
    draft): passkey and the generation tasks."""
    return [(t, v) for t, v in todo if t != "ppl"]


def _unit_calls(spec: EvalSpec, length: int, todo: Sequence[tuple[str, str]]) -> int:
    """Forward calls of one (method, budget, length)'s units `todo` (the progress bar's steps)."""
    together = len(_generation_units(spec, todo)) * spec.samples
    calls = -(-together // spec.generation_rows(length, together)) if together else 0
    for task, variant in todo:
        if task == "ppl":
            calls += -(-spec.ppl_windows() // spec.ppl_rows(length)) * {
                "decode": -(-length // spec.chunk), "prefill": 1,
                "continuation": 1 + -(-spec.continuation // spec.chunk)}[variant]
    return calls


def _score_records(task: str, metric: str, scores: Sequence[float], depths: Sequence, seconds: float,
                   variant: str, rate_of: Callable[[Sequence[int]], float | None] = lambda idx: None,
                   **common) -> list[dict]:
    """The record over all samples, then one per needle depth (when the samples have depths). rate_of(sample
    indices): the acceptance rate over those samples' rounds (each record's own); a per-depth record's sparsity is
    the record over all depths' and its layer_sparsity None (measured over all depths' prefills together)."""
    new = [make_record(task=task, metric=metric, value=float(np.mean(scores)), n=len(scores), variant=variant,
                       depth=None, seconds=seconds, acceptance_rate=rate_of(range(len(scores))), **common)]
    per_depth = {**common, "layer_sparsity": None}
    for depth in sorted({d for d in depths if d is not None}):
        idx = [i for i, d in enumerate(depths) if d == depth]
        new.append(make_record(task=task, metric=metric, value=float(np.mean([scores[i] for i in idx])), n=len(idx),
                               variant=variant, depth=depth, seconds=None, acceptance_rate=rate_of(idx),
                               **per_depth))
    return new


def evaluate(model, spec: EvalSpec, *, progress: bool = True,
             on_record: Callable[[list[dict], list[dict]], None] | None = None,
             previous: Sequence[Mapping] = ()) -> EvalRun:
    """Runs every (method, budget, task, variant, length) of `spec` on `model`.

    Args:
      model: a LoadedModel (anything with .cfg, .params, .tokenizer).
      spec: what to run (validated here).
      progress: show a tqdm progress bar on stderr.
      on_record: called with all records so far (`previous` first) and this run's outputs so far (the per-sample
        completions of the units recorded) after each unit, e.g. to write results.json and outputs.json
        as the run goes.
      previous: records of an earlier run of the same configuration: their units (`record_key`) are skipped
        (the resume of an interrupted run) and they lead the returned records.
    Returns:
      EvalRun with `previous` + the new records and the new per-sample outputs.
    """
    from tqdm.auto import tqdm

    spec.validate()
    cfg = model.cfg
    if getattr(model, "tokenizer", None) is None:
        raise ValueError(f"model {getattr(model, 'name', '?')!r} has no tokenizer: the eval tasks need one (a "
                         "Hugging Face folder with tokenizer files, a GGUF, or the bundled smollm2)")
    generation = {t: task for t, task in generation_tasks().items() if t in spec.tasks}
    gen_new = max([spec.new_tokens] * ("passkey" in spec.tasks) + [t.max_new_tokens for t in generation.values()],
                  default=spec.new_tokens)
    # The most prompt tokens of a length: the generation tasks' prompts may pass it by 1% unless exact.
    prompt_max = {L: max([L] + [t.max_prompt(L) for t in generation.values()]) for L in spec.lengths}
    # Where the new tokens come from, for the errors of a length too long (they name the request's fields).
    news = [f"passkey {spec.new_tokens} (--new-tokens)"] * ("passkey" in spec.tasks) + \
        [f"{name} {task.max_new_tokens}" for name, task in generation.items()]
    for length in spec.lengths:  # fail before any work on a length the model cannot run
        try:
            if "passkey" in spec.tasks or generation:
                check_request(cfg, [prompt_max[length]], gen_new,
                              verify_rows=0 if spec.draft is None else spec.gamma + 1)
                if spec.draft is not None and hasattr(spec.draft, "cfg"):
                    from jsparse.api import check_draft_context

                    check_draft_context(spec.draft, [prompt_max[length]], gen_new)
            if "ppl" in spec.tasks:
                check_request(cfg, [length - 1], 1)
        except ValueError as e:
            raise ValueError(f"length {length} (--lengths): {e}; the run's new tokens are the most any of its tasks "
                             f"generates: {', '.join(news) or 'ppl 1'}") from None
    context = cfg.max_position_embeddings
    if spec.budget_tokens is not None and max(spec.budget_tokens) > context:  # named by its flag, not its option
        raise ValueError(f"--budget-tokens {max(spec.budget_tokens)}: more than the model's context of {context} "
                         "tokens; expected at most that")
    check_calibration_corpus(spec)
    corpus_ids = None
    slots: dict[int, int] = {}  # ppl: non-overlapping windows the corpus holds at each length
    if "ppl" in spec.tasks or ("passkey" in spec.tasks and spec.haystack == "corpus"):
        corpus_ids = ppl_task.tokenize_corpus(model.tokenizer, ppl_task.read_corpus(spec.corpus))
        windows, flag = ((spec.ppl_windows(), "--samples" if spec.ppl_samples is None else "--ppl-samples")
                         if "ppl" in spec.tasks else (spec.samples, "--samples"))
        for length in spec.lengths:  # a corpus too short for the windows fails before any work, naming the file
            try:
                slots[length] = ppl_task.check_windows(model.tokenizer, corpus_ids, length, windows, flag)
            except ValueError as e:
                raise ValueError(f"--corpus {spec.corpus!r} at length {length}: {e}") from None
    methods = build_methods(model, spec)
    done = {record_key(r) for r in previous}
    units = _units(spec)
    # Max visible keys of a length (token budgets).
    visible = {L: prompt_max[L] + (gen_new if generation or "passkey" in spec.tasks else 0) for L in spec.lengths}
    plan = [(L, run, [(t, v) for t, v in units
                      if (run.name, None if run.budget_tokens is not None else run.budget, run.budget_tokens, t, L,
                          v) not in done])
            for L in spec.lengths for run in method_runs(model, spec, methods, visible[L])]

    records: list[dict] = [dict(r) for r in previous]
    outputs: list[dict] = []
    ppl_overlap: dict = {}
    total = sum(_unit_calls(spec, L, todo) for L, _, todo in plan)
    bar = tqdm(total=total, disable=not progress, unit="call", dynamic_ncols=True)
    tick = lambda: bar.update(1)  # noqa: E731

    def emit(new: list[dict]) -> None:
        records.extend(new)
        if on_record is not None:
            on_record(list(records), list(outputs))

    try:
        for length in spec.lengths:
            if "ppl" in spec.tasks and spec.ppl_windows() > slots[length]:  # (a resumed run's done lengths too:
                ppl_overlap[length] = (spec.ppl_windows(), slots[length])    # the run's meta says it of all of them)
            todo_tasks = {t for L, _, todo in plan if L == length for t, _ in todo}
            if not todo_tasks:
                continue
            prompts = windows = None
            samples = {}
            if "passkey" in todo_tasks:
                prompts = passkey_task.make_prompts(
                    model.tokenizer, length, spec.samples, spec.seed, spec.depths,
                    corpus_ids if spec.haystack == "corpus" else None)
            if "ppl" in todo_tasks:
                windows = ppl_task.make_windows(model.tokenizer, corpus_ids, length, spec.ppl_windows(), spec.seed)
            haystack = generation_haystack(spec)
            for name, task in generation.items():
                if name in todo_tasks:
                    samples[name] = task.make_samples(model.tokenizer, length, spec.samples, spec.seed,
                                                      haystack=haystack, chat=spec.chat)
            # One compiled generate per (method, length): every generation task pads to one width.
            width = max([length] * (prompts is not None) + [len(s.tokens) for ss in samples.values() for s in ss],
                        default=length)
            for L, run, todo in plan:
                if L != length or not todo:
                    continue
                method = run.build()
                name, budget, budget_tokens = run.name, run.budget, run.budget_tokens
                sparsity = functools.partial(achieved_sparsity, method, name, cfg, length,
                                             continuation=spec.continuation)  # of a record's variant
                common = dict(method=name, length=length, budget=budget, budget_tokens=budget_tokens)

                def prompt_sparsity(measured, mean, variant, sparsity=sparsity):  # a generation record's
                    if mean is not None:  # measured on its prefills
                        return mean
                    if measured.active and spec.draft is not None:
                        return None  # a prefill-measured method under speculative decoding: not measured
                    return sparsity(variant)  # by the method's rule
                # Passkey and the generation tasks: their prompts in shared generate calls (speculative decoding
                # ones with a draft).
                together = _generation_units(spec, todo)
                done_gen = {}
                if together:
                    bar.set_description(f"{run.label} {'+'.join(t for t, _ in together)} {length}")
                    t0 = time.perf_counter()
                    tokens, new, owners, trackers = [], [], [], {}
                    for task, _ in together:
                        trackers[task] = LayerSparsity(method, cfg)
                        if task == "passkey":
                            toks, n_new = [p.tokens for p in prompts], spec.new_tokens
                        else:
                            toks, n_new = [s.tokens for s in samples[task]], generation[task].max_new_tokens
                        tokens += toks
                        new += [n_new] * len(toks)
                        owners += [task] * len(toks)
                    spec_stats: dict = {}
                    completions = run_generation(model, method, tokens, new, spec.generation_rows(length, len(tokens)),
                                                 tick, [trackers[o] for o in owners], width=width,
                                                 max_new_tokens=gen_new, draft=spec.draft, gamma=spec.gamma,
                                                 stats=spec_stats)
                    elapsed = time.perf_counter() - t0
                    for task, _ in together:
                        idx = [i for i, o in enumerate(owners) if o == task]
                        done_gen[task] = ([completions[i] for i in idx], trackers[task],
                                          elapsed * len(idx) / len(tokens),
                                          lambda sub, own=idx, stats=spec_stats: acceptance_rate(
                                              stats, [own[i] for i in sub]))
                for task, variant in todo:
                    bar.set_description(f"{run.label} {task}{'' if task != 'ppl' else '-' + variant} {length}")
                    t0 = time.perf_counter()
                    measured = LayerSparsity(method, cfg)
                    if task == "passkey":
                        completions, measured, seconds, rate_of = done_gen[task]
                        layers, mean = measured.result()
                        correct = [passkey_task.is_correct(c, p.key) for p, c in zip(prompts, completions)]
                        for p, c, ok in zip(prompts, completions, correct):
                            outputs.append(dict(task="passkey", method=name, budget=budget,
                                                budget_tokens=budget_tokens, length=length, depth=p.depth,
                                                answers=[p.key], completion=c, score=float(ok)))
                        emit(_score_records("passkey", "accuracy", [float(ok) for ok in correct],
                                            [p.depth for p in prompts], seconds, "generate", rate_of,
                                            sparsity=prompt_sparsity(measured, mean, "generate"),
                                            layer_sparsity=layers, **common))
                    elif task == "ppl":
                        nll = run_ppl(model, method, windows, variant, spec.ppl_rows(length), spec.chunk, tick,
                                      spec.continuation, measured, draft=spec.draft, gamma=spec.gamma)
                        seconds = time.perf_counter() - t0
                        layers, mean = measured.result()
                        emit([make_record(task="ppl", metric="perplexity", value=ppl_task.perplexity(nll),
                                          n=len(nll), variant=variant, depth=None, seconds=seconds,
                                          sparsity=sparsity(variant) if mean is None else mean,
                                          layer_sparsity=layers, **common)])
                    else:
                        gen = generation[task]
                        ss = samples[task]
                        completions, measured, seconds, rate_of = done_gen[task]
                        layers, mean = measured.result()
                        from eval import tasks as task_registry

                        scores = [float(task_registry.score(gen, c, s.answers)) for s, c in zip(ss, completions)]
                        for s, c, x in zip(ss, completions, scores):
                            outputs.append(dict(task=task, method=name, budget=budget, budget_tokens=budget_tokens,
                                                length=length, depth=s.depth, answers=list(s.answers),
                                                completion=c, score=x))
                        emit(_score_records(task, gen.metric, scores, [s.depth for s in ss], seconds, variant,
                                            rate_of, sparsity=prompt_sparsity(measured, mean, variant),
                                            layer_sparsity=layers, **common))
    finally:
        bar.close()
    return EvalRun(records=records, outputs=outputs, ppl_overlap=ppl_overlap)
