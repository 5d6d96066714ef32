"""The public API: load a model, build an attention method by name, generate text.

    import jsparse
    model = jsparse.load("smollm2")                       # or an HF folder, or a .gguf file
    method = jsparse.build_method("dense", model)
    print(jsparse.generate(model, ["What is the capital of France?"], method=method, chat=True)[0])

Speculative decoding: `jsparse.generate(model, prompts, draft=jsparse.load("smollm2:layers=0-9"), gamma=4)`
(any draft with the target's vocabulary; `SPEC:layers=A-B,C` keeps those layers of a model, a cheap local
draft). With `method="sts"` the draft's attention also chooses the keys the target attends to (STS). On a mesh,
the target and the draft are loaded with the same `mesh=` and both run sharded on it.
"""

from __future__ import annotations

import dataclasses
import os
import reprlib
import warnings
from typing import Any, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jsparse.artifacts import check_calibrated_for, fingerprint
from jsparse.methods import make_method, method_names, window_methods
from models import sharding
from models.bundled import LoadedModel, keep_layers, load_model, parse_layers  # noqa: F401  (re-exported)
from models.params import unfuse_projections
from models.generate import (NEW_TOKENS_BUCKET, Sampling, check_request, check_seed, check_token_ids,
                             generate_tokens, round_up, seed_key, sharded_generate_tokens)
from models.speculative import check_gamma, check_pair, sharded_speculative_generate, speculative_generate

_DTYPES = {"float32": jnp.float32, "f32": jnp.float32, "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16}


def default_dtype() -> str:
    """bf16 on accelerators, f32 on the CPU (where bf16 matmuls are slow and exactness is worth more)."""
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def load(spec: str = "smollm2", dtype: str | None = None, mesh: Any = None, fuse: bool | None = None) -> LoadedModel:
    """Loads `smollm2` (the bundled model), a Hugging Face folder or a GGUF file.

    `SPEC:layers=0-9` (ranges and single layers, comma-separated, e.g. `layers=0-5,29`) keeps only those layers
    of the loaded model, in order: a layer-skipped copy that serves as a cheap speculative draft.

    mesh: None (one device), a `jax.sharding.Mesh` with axes ("data", "model"), or a spec such as
    "data=2,model=4" (`models.sharding.make_mesh` over `jax.devices()`): the params are placed on it by heads (q/k/v/o),
    MLP hidden and vocabulary (`models.sharding.AXIS_RULES`), each device receiving only its shards, and
    `generate` runs sharded (a speculative draft is loaded with the same mesh). Raises ValueError when a head
    count does not divide the model axis.

    fuse: hold q/k/v and gate/up as one weight each, one GEMM per pair in every layer (`models.params`); None (the
    default) fuses on a GPU without a mesh, where it saves 0.4-0.5 ms per Llama-3.1-8B decode step on an H200
    (`eval/results/h200/fused/`). The outputs and artifact fingerprints do not depend on it.

    Raises:
      ValueError: an unknown dtype; a head count that does not divide the mesh's model axis; fuse=True with a
        mesh (fused weights cannot be split by heads).
    """
    if not isinstance(spec, (str, os.PathLike)):
        raise ValueError(f"model {spec!r}: expected 'smollm2', a Hugging Face folder or a .gguf path")
    dtype = dtype or default_dtype()
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {sorted(_DTYPES)}")
    if fuse is not None and not isinstance(fuse, bool):
        raise ValueError(f"fuse={fuse!r}: expected True, False or None (fuse on a GPU without a mesh)")
    mesh = _mesh_arg(mesh, allow_none=True)  # a bad spec fails before the model loads
    return load_model(spec, dtype=_DTYPES[dtype], mesh=mesh, fuse=fuse)


def _mesh_arg(mesh: Any, allow_none: bool):
    """A mesh argument: a `jax.sharding.Mesh`, a spec string (`models.sharding.make_mesh`) or, where allowed, None."""
    if isinstance(mesh, str):
        return sharding.make_mesh(mesh)
    if isinstance(mesh, jax.sharding.Mesh):
        if set(mesh.axis_names) != set(sharding.MESH_AXES):
            raise sharding.ShardingError(f"a mesh with axes {tuple(mesh.axis_names)}: expected the axes "
                                         f"{sharding.MESH_AXES} (rows over data, heads over model; "
                                         "models.sharding.make_mesh builds one)")
        return mesh
    if mesh is None and allow_none:
        return mesh
    raise ValueError(f"mesh={mesh!r}: expected a jax.sharding.Mesh or a spec such as 'data=2,model=4'"
                     + (" (or None: one device)" if allow_none else ""))


def on_mesh(model: LoadedModel, mesh: Any) -> LoadedModel:
    """`model` with its params placed on `mesh` (a Mesh or a spec string, see `load`)."""
    mesh = _mesh_arg(mesh, allow_none=False)
    sharding.check_heads(model.cfg, mesh)
    params = sharding.shard_params(model.cfg, unfuse_projections(model.params), mesh)  # sharded: separate layout
    return dataclasses.replace(model, params=params, mesh=mesh)


def check_model(model: Any, arg: str = "model") -> None:
    """A loaded model (`jsparse.load(SPEC)`); anything else (its name, a path) is refused here, not as an attribute
    error further in."""
    if not isinstance(model, LoadedModel):
        raise ValueError(f"{arg}={reprlib.repr(model)}: expected a loaded model (`jsparse.load(SPEC)`, e.g. "
                         "jsparse.load('smollm2'))")


def build_method(name: str, model: LoadedModel | None = None, **options: Any):
    """Builds a registered method; `options` (budget, artifact, ...) go to its builder.

    An `artifact` path is checked against the model's fingerprint by the method's builder. With a model, `cfg` and
    `fingerprint` come from it: given as options they are refused (another fingerprint would pass an artifact made
    for another model).
    """
    if model is not None:
        check_model(model)
        given = sorted(k for k in ("cfg", "fingerprint") if k in options)
        if given:
            raise ValueError(f"build_method({name!r}, model, {', '.join(f'{k}=...' for k in given)}): "
                             f"{' and '.join(given)} come from the model; leave them out (or call "
                             "jsparse.make_method without a model)")
        options["cfg"] = model.cfg
        if options.get("artifact"):
            options["fingerprint"] = fingerprint(model)
    return make_method(name, **options)


def encode(model: LoadedModel, prompts: str | Sequence[str], chat: bool = False) -> list[int] | list[list[int]]:
    """Tokenizes prompts (with the model's chat template when `chat`): one prompt (a str) -> its token ids, a list
    of prompts -> one list of ids per prompt."""
    if isinstance(prompts, str):
        return encode(model, [prompts], chat)[0]
    check_model(model)
    _check_prompts(prompts)
    if not isinstance(chat, (bool, np.bool_)):
        raise ValueError(f"chat={chat!r}: expected True or False")
    tok = model.tokenizer
    if tok is None:
        raise ValueError(f"model {getattr(model, 'name', '?')!r} has no tokenizer (a Hugging Face folder without "
                         "tokenizer files): pass token ids to `generate_ids`, or load a folder with its tokenizer")
    out = []
    for p in prompts:
        if chat:
            text = tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True)
            ids = tok(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tok(p)["input_ids"]
        out.append(list(ids))
    return out


PROMPT_BUCKET = 64  # prompts are padded to a multiple of this many tokens: one compilation serves a bucket


def pad_batch(token_lists: Sequence[Sequence[int]], multiple: int = PROMPT_BUCKET, limit: int | None = None):
    """Right-pads token lists to a bucketed length: returns (i32[B, T], i32[B] lengths)."""
    if not len(token_lists):
        raise ValueError("no prompts given: expected at least one token list")
    lengths = np.array([len(t) for t in token_lists], np.int32)
    T = round_up(int(lengths.max()), multiple)
    if limit is not None:
        T = max(min(T, limit), int(lengths.max()))
    tokens = np.zeros((len(token_lists), T), np.int32)
    for i, t in enumerate(token_lists):
        tokens[i, : len(t)] = t
    return tokens, lengths


def eos_ids(model: LoadedModel) -> tuple[int, ...]:
    """The ids that end a row: the config's, a folder's generation_config.json ones or a GGUF's end-of-turn ones
    (`LoadedModel.stop_ids`) and the tokenizer's eos token."""
    eos = tuple(model.cfg.eos_token_ids)
    eos = eos + tuple(t for t in getattr(model, "stop_ids", ()) if t not in eos)
    tok = model.tokenizer
    if tok is not None and tok.eos_token_id is not None and tok.eos_token_id not in eos:
        eos = eos + (tok.eos_token_id,)
    return eos


def check_method(method: Any) -> None:
    """A method is a registered name or a method object (`models.attention.AttentionMethod`: init_state, prefill,
    decode); anything else is refused here, not as an attribute error inside the model."""
    if isinstance(method, str):
        return
    if isinstance(method, type) or not all(callable(getattr(method, f, None))
                                           for f in ("init_state", "prefill", "decode")):
        raise ValueError(f"method={reprlib.repr(method)}: expected a method name (one of {method_names()}) or a method "
                         "object (`jsparse.build_method(name, model)`)")


def check_draft(model: LoadedModel, draft: LoadedModel, gamma: int) -> None:
    """A draft must be a loaded model sharing the target's vocabulary (and tokenizer, where both have one) and its
    mesh (both on the same mesh, or neither on one); gamma >= 1."""
    if not isinstance(draft, LoadedModel):
        raise ValueError(f"draft={reprlib.repr(draft)}: expected a loaded model (`jsparse.load(SPEC)`, e.g. "
                         "jsparse.load('smollm2:layers=0-14'))")
    check_gamma(gamma)
    check_pair(model.cfg, draft.cfg)
    tm, td = model.tokenizer, draft.tokenizer
    if tm is not None and td is not None and tm is not td:
        if len(tm) != len(td):
            raise ValueError(f"draft tokenizer has {len(td)} tokens, the target's {len(tm)}: a draft must share the "
                             "target's tokenizer")
        vm, vd = (getattr(t, "get_vocab", lambda: None)() for t in (tm, td))  # {token: id} with the added tokens
        if vm is not None and vd is not None and vm != vd:
            by_m, by_d = ({i: t for t, i in v.items()} for v in (vm, vd))
            i = next(i for i in sorted(set(by_m) | set(by_d)) if by_m.get(i) != by_d.get(i))
            raise ValueError(f"draft tokenizer's token {i} is {by_d.get(i)!r}, the target's {by_m.get(i)!r}: a "
                             "draft must share the target's tokenizer (the same number of tokens is not enough)")
    if not _same_mesh(model.mesh, draft.mesh):
        raise ValueError(f"the target is on {_mesh_text(model.mesh)} and the draft on {_mesh_text(draft.mesh)}: "
                         "speculative decoding runs both models on the same mesh; load them with the same mesh= "
                         "(--mesh loads both)")


def check_draft_context(draft: LoadedModel, prompt_lengths: Sequence[int], max_new_tokens: int) -> None:
    """The draft reads the whole conversation too: the prompt plus the new tokens must fit its context as well."""
    need = max(prompt_lengths) + max_new_tokens
    if need > draft.cfg.max_position_embeddings:
        raise ValueError(f"prompt ({max(prompt_lengths)} tokens) plus max_new_tokens={max_new_tokens} is {need} "
                         f"tokens, longer than the draft's context of {draft.cfg.max_position_embeddings}")


def _same_mesh(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.axis_names == b.axis_names and a.devices.shape == b.devices.shape and \
        [d.id for d in a.devices.flat] == [d.id for d in b.devices.flat]


def _mesh_text(mesh) -> str:
    if mesh is None:
        return "one device (no mesh)"
    return "a mesh " + ",".join(f"{k}={v}" for k, v in dict(mesh.shape).items())


def speculative_methods(method: Any, model: LoadedModel, draft: LoadedModel, gamma: int):
    """(target method, draft method) for speculative decoding: a method that takes its selection from the draft
    (STS: `for_round`) names the draft's method; any other method pairs with a dense draft."""
    check_method(method)
    if isinstance(method, str):
        method = build_method(method, model, draft=draft) if method == "sts" else build_method(method, model)
    for_round = getattr(method, "for_round", None)
    if for_round is not None:
        want = getattr(method, "draft_fingerprint", None)
        if want is not None and want != fingerprint(draft):
            raise ValueError(f"the STS head map was calibrated with the draft of fingerprint {want}, but this draft "
                             f"({getattr(draft, 'name', '?')}) has {fingerprint(draft)}: build STS with the draft "
                             "it runs with, or calibrate a head map for this one (`jsparse calibrate sts`)")
        return for_round(draft.cfg, gamma)
    return method, make_method("dense")


def sampling_of(temperature: float, top_p: float, seed: int = 0) -> Sampling:
    """`Sampling(temperature, top_p)` (which checks both), with a warning when top_p or a seed (other than 0) is set at
    temperature 0: greedy decoding takes the argmax, and neither has an effect there (top_p runs as 1, the same
    compiled program)."""
    sampling = Sampling(temperature, top_p)
    # Attributed to the caller's line, past every frame of this package (generate -> generate_ids -> here).
    caller = (os.path.dirname(os.path.abspath(__file__)) + os.sep,)
    if sampling.greedy and seed != 0:
        warnings.warn(f"seed={seed} has no effect at temperature 0 (greedy decoding): pass a temperature > 0 to "
                      "sample", skip_file_prefixes=caller)
    if sampling.greedy and sampling.nucleus:
        warnings.warn(f"top_p={top_p} has no effect at temperature 0 (greedy decoding): pass a temperature > 0 to "
                      "sample", skip_file_prefixes=caller)
        return Sampling(0.0, 1.0)
    return sampling


def fit_windows(pairs, need: int, capacity: int, capped: bool, asked: str | None = None, verify_rows: int = 0) -> int:
    """The cache capacity for models with sliding windows run by methods that may not honour them.

    pairs: (LoadedModel, method) for the target (and the draft). A method outside `window_methods()` on a model
    whose window W is shorter than `need` (prompt + new tokens (+ speculative rows)) is refused; within the window
    it runs, with the default capacity (`capped`) cut to W rounded down to whole blocks (`window_capacity`), so the
    window never binds. asked: what `need` is, for the refusal (None: a request's prompt plus max_new_tokens, plus `verify_rows`, speculative decoding's gamma + 1
    verification rows, which the refusal then names).
    """
    for model, method in pairs:
        W = model.cfg.window_size
        if W is None or getattr(method, "supports_window", False):
            continue
        if need > W:
            rows = f" (prompt plus max_new_tokens plus gamma + 1 = {verify_rows} verification rows)" if verify_rows else ""
            what = asked or f"this request needs {need} tokens{rows}"
            fix = (f"a value <= {W}" if asked else f"prompt plus max_new_tokens within {W} tokens" if not verify_rows
                   else f"prompt plus max_new_tokens plus gamma + 1 within {W} tokens (a smaller gamma or fewer new "
                        "tokens)")
            raise ValueError(
                f"method {type(method).__name__} does not support sliding-window attention and {what}, more than "
                f"{model.name}'s sliding_window={W}; use one of {window_methods()} or keep {fix}")
        if capped:
            capacity = min(capacity, window_capacity(W, need))
    return capacity


def window_capacity(W: int, need: int) -> int:
    """The largest cache capacity <= W (a window that never binds) on the coarsest grid of 128 rows, 16 (EvoSparse's
    blocks, which a capacity must be made of) or 1 that still holds `need` rows (and one at least)."""
    for grid in (128, 16, 1):
        if W // grid * grid >= max(need, 1):
            return W // grid * grid
    raise ValueError(f"need={need}: expected at most the window of {W}")


def generate_ids(model: LoadedModel, ids: Sequence[Sequence[int]], *, method: Any = "dense",
                 max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                 capacity: int | None = None, draft: LoadedModel | None = None, gamma: int = 4,
                 stats: dict | None = None) -> list[list[int]]:
    """Token-level `generate`: prompts as token lists -> generated tokens per row (EOS included).

    With `draft`, speculative decoding (gamma draft tokens per round; on a mesh the draft must be on the
    target's mesh); `stats`, when given, receives `rounds`, `accepted` and `acceptance_rate` (accepted draft
    tokens / proposed ones, gamma a round: how often the target agreed with the draft, so a round's accepted tokens
    count in full even where the row ends inside them at an EOS or at max_new_tokens) of the speculative rounds
    (without a draft there are none: it is left unchanged).
    """
    prompts = None if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable) else list(ids)  # read once
    if prompts is None or any(isinstance(t, (int, np.integer)) for t in prompts):
        raise ValueError("ids: expected a list of prompts, each a list of token ids ([[1, 2, 3]] for one prompt), "
                         f"got {str(ids if prompts is None else prompts)[:60]!r}")
    ids = prompts
    check_model(model)
    if stats is not None and not isinstance(stats, dict):
        raise ValueError(f"stats={stats!r}: expected a dict to receive the speculative rounds' counts, or None")
    check_method(method)
    if not isinstance(method, str):  # built for another model's shapes (named by them), then calibrated for another
        from models.attention import check_model as check_shapes
        check_shapes(method, model.cfg)
        check_calibrated_for(method, model)
    check_seed(seed)
    check_gamma(gamma)
    check_token_ids(model.cfg, ids)
    if draft is None and getattr(method, "needs_draft", False):
        raise ValueError("method 'sts' takes its selection from a draft model: pass draft= (--draft) as well")
    if draft is not None:
        check_draft(model, draft, gamma)
    if draft is None:
        method = build_method(method, model) if isinstance(method, str) else method
        pairs = [(model, method)]
    else:
        t_method, d_method = speculative_methods(method, model, draft, gamma)
        pairs = [(model, t_method), (draft, d_method)]
    lengths_list = [len(t) for t in ids]
    extra = 0 if draft is None else gamma + 1  # the verification writes up to gamma + 1 rows past the accepted
    chosen = capacity
    capacity = check_request(model.cfg, lengths_list, max_new_tokens, capacity, verify_rows=extra)
    if chosen is None:  # from the padded prompt (and, speculative, the bucketed new tokens): two requests of one
        # bucket share the capacity, so they share the compilation
        new = max_new_tokens if draft is None else round_up(max_new_tokens, NEW_TOKENS_BUCKET)
        capacity = max(capacity, round_up(round_up(max(lengths_list), PROMPT_BUCKET) + new + extra, 128))
    else:  # a capacity past a window a method does not honour is refused by name, as Session does
        fit_windows(pairs, chosen, chosen, capped=False, asked=f"capacity={chosen}")
    if draft is not None:
        check_draft_context(draft, lengths_list, max_new_tokens)
    capacity = fit_windows(pairs, max(lengths_list) + max_new_tokens + extra, capacity, capped=chosen is None,
                           verify_rows=extra)
    tokens, lengths = pad_batch(ids, limit=capacity - max_new_tokens - extra)
    eos = eos_ids(model)
    sampling = sampling_of(temperature, top_p, seed)
    rows = len(ids)
    if model.mesh is not None:
        # Rows over the data axis: pad the batch with copies of row 0 to a multiple of it, drop them after.
        extra_rows = -rows % sharding.mesh_size(model.mesh, "data")
        tokens = np.concatenate([tokens, np.repeat(tokens[:1], extra_rows, 0)])
        lengths = np.concatenate([lengths, np.repeat(lengths[:1], extra_rows, 0)])
    if draft is None and model.mesh is not None:
        out, num = sharded_generate_tokens(model.mesh, model.params, method, tokens, lengths, seed_key(seed),
                                           cfg=model.cfg, max_new_tokens=max_new_tokens, capacity=capacity,
                                           sampling=sampling, eos_ids=eos)
    elif draft is None:
        out, num = generate_tokens(model.params, method, jnp.asarray(tokens), jnp.asarray(lengths),
                                   seed_key(seed), cfg=model.cfg, max_new_tokens=max_new_tokens,
                                   capacity=capacity, sampling=sampling, eos_ids=eos)
    else:
        # The rounds' output width in buckets, each row's count traced (one compilation serves a bucket), where the
        # cache holds the bucket's rows (a capacity cut to a sliding window may not).
        width = round_up(max_new_tokens, NEW_TOKENS_BUCKET)
        width = width if tokens.shape[1] + width + extra <= capacity else max_new_tokens
        spec = dict(t_cfg=model.cfg, d_cfg=draft.cfg, gamma=gamma, max_new_tokens=width, capacity=capacity,
                    sampling=sampling, eos_ids=eos, row_new_tokens=np.full(len(tokens), max_new_tokens, np.int32))
        if model.mesh is not None:  # the draft is on the same mesh (check_draft)
            out, num, rounds, accepted = sharded_speculative_generate(
                model.mesh, model.params, draft.params, t_method, d_method, tokens, lengths, seed_key(seed),
                **spec)
        else:
            out, num, rounds, accepted = speculative_generate(
                model.params, draft.params, t_method, d_method, jnp.asarray(tokens), jnp.asarray(lengths),
                seed_key(seed), **spec)
        rounds, accepted = np.asarray(rounds)[:rows], np.asarray(accepted)[:rows]
        if stats is not None:
            r, acc = int(np.sum(rounds)), int(np.sum(accepted))
            stats.update(rounds=r, accepted=acc, acceptance_rate=acc / max(r * gamma, 1))
    out, num = np.asarray(out)[:rows], np.asarray(num)[:rows]
    return [[int(t) for t in row[:n]] for row, n in zip(out, num)]


def _check_prompts(prompts) -> None:
    if not isinstance(prompts, Sequence) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"prompts={prompts!r:.80}: expected a str or a non-empty list of str")


def generate(model: LoadedModel, prompts: str | Sequence[str], *, method: Any = "dense", max_new_tokens: int = 64,
             chat: bool = False, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
             capacity: int | None = None, draft: LoadedModel | None = None, gamma: int = 4,
             stats: dict | None = None) -> str | list[str]:
    """Generates a completion for every prompt (one batch, per-row lengths, stops at EOS).

    Args:
      prompts: one prompt (a str; the completion is returned as a str) or a list of prompts (a list of
        completions is returned, in order).
      method: a method object or a method name (built with default options).
      chat: wrap each prompt in the model's chat template as a user turn (what instruct models expect).
      draft: a model with the target's vocabulary: speculative decoding with `gamma` draft tokens per round
        (greedy acceptance at temperature 0, speculative rejection sampling otherwise). `stats`: see
        `generate_ids`.

    On a model with sliding-window layers, a method outside `window_methods()` runs only while the request fits
    the window (see `fit_windows`).
    """
    if isinstance(prompts, str):
        return generate(model, [prompts], method=method, max_new_tokens=max_new_tokens, chat=chat,
                        temperature=temperature, top_p=top_p, seed=seed, capacity=capacity, draft=draft,
                        gamma=gamma, stats=stats)[0]
    _check_prompts(prompts)
    ids = encode(model, prompts, chat)
    rows = generate_ids(model, ids, method=method, max_new_tokens=max_new_tokens, temperature=temperature,
                        top_p=top_p, seed=seed, capacity=capacity, draft=draft, gamma=gamma, stats=stats)
    eos = eos_ids(model)
    texts = []
    for row in rows:
        toks = [t for t in row if t >= 0 and t not in eos]
        texts.append(model.tokenizer.decode(toks, skip_special_tokens=True))
    return texts
