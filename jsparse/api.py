"""The public API: load a model, build an attention method by name, generate text.

    import jsparse
    model = jsparse.load("smollm2")                       # or an HF folder, or a .gguf file
    method = jsparse.build_method("dense", model)
    print(jsparse.generate(model, ["What is the capital of France?"], method=method, chat=True)[0])
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jsparse.artifacts import model_fingerprint
from jsparse.methods import make_method, window_methods
from models.bundled import LoadedModel, load_model
from models.generate import Sampling, check_request, generate_tokens, round_up

_DTYPES = {"float32": jnp.float32, "f32": jnp.float32, "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16}


def default_dtype() -> str:
    """bf16 on accelerators, f32 on the CPU (where bf16 matmuls are slow and exactness is worth more)."""
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def load(spec: str = "smollm2", dtype: str | None = None) -> LoadedModel:
    """Loads `smollm2` (the bundled model), a Hugging Face folder or a GGUF file."""
    dtype = dtype or default_dtype()
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {sorted(_DTYPES)}")
    return load_model(spec, dtype=_DTYPES[dtype])


def fingerprint(model: LoadedModel) -> str:
    """The model's fingerprint (cached on the LoadedModel), used to key calibration artifacts."""
    fp = getattr(model, "_fingerprint", None)
    if fp is None:
        fp = model_fingerprint(model.cfg, model.params)
        object.__setattr__(model, "_fingerprint", fp)
    return fp


def build_method(name: str, model: LoadedModel | None = None, **options: Any):
    """Builds a registered method; `options` (budget, artifact, ...) go to its builder.

    An `artifact` path is checked against the model's fingerprint by the method's builder.
    """
    if model is not None:
        options.setdefault("cfg", model.cfg)
        if options.get("artifact"):
            options.setdefault("fingerprint", fingerprint(model))
    return make_method(name, **options)


def encode(model: LoadedModel, prompts: Sequence[str], chat: bool = False) -> list[list[int]]:
    """Tokenizes prompts (with the model's chat template when `chat`)."""
    tok = model.tokenizer
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


def pad_batch(token_lists: Sequence[Sequence[int]], multiple: int = 64, limit: int | None = None):
    """Right-pads token lists to a bucketed length: returns (i32[B, T], i32[B] lengths)."""
    lengths = np.array([len(t) for t in token_lists], np.int32)
    T = round_up(int(lengths.max()), multiple)
    if limit is not None:
        T = max(min(T, limit), int(lengths.max()))
    tokens = np.zeros((len(token_lists), T), np.int32)
    for i, t in enumerate(token_lists):
        tokens[i, : len(t)] = t
    return tokens, lengths


def generate(model: LoadedModel, prompts: Sequence[str], *, method: Any = "dense", max_new_tokens: int = 64,
             chat: bool = False, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
             capacity: int | None = None) -> list[str]:
    """Generates a completion for every prompt (one batch, per-row lengths, stops at EOS).

    On a model with sliding-window layers (`model.cfg.window_size`), a method that does not honour the window
    (not in `window_methods()`) runs only while prompt plus new tokens fit the window (the window then never
    binds; the default cache capacity is capped at it) and is refused otherwise.
    """
    if isinstance(method, str):
        method = build_method(method, model)
    ids = encode(model, prompts, chat)
    chosen = capacity
    capacity = check_request(model.cfg, [len(t) for t in ids], max_new_tokens, capacity)
    W = model.cfg.window_size
    if W is not None and not getattr(method, "supports_window", False):
        need = max(len(t) for t in ids) + max_new_tokens
        if need > W:
            raise ValueError(
                f"method {type(method).__name__} does not support sliding-window attention and prompt plus "
                f"max_new_tokens is {need} tokens, more than the model's sliding_window={W}; use one of "
                f"{window_methods()} or keep the request within {W} tokens")
        if chosen is None:
            capacity = min(capacity, W)
    tokens, lengths = pad_batch(ids, limit=capacity - max_new_tokens)
    eos = tuple(model.cfg.eos_token_ids)
    if model.tokenizer.eos_token_id is not None and model.tokenizer.eos_token_id not in eos:
        eos = eos + (model.tokenizer.eos_token_id,)
    out, num = generate_tokens(model.params, method, jnp.asarray(tokens), jnp.asarray(lengths),
                               jax.random.key(seed), cfg=model.cfg, max_new_tokens=max_new_tokens,
                               capacity=capacity, sampling=Sampling(temperature, top_p), eos_ids=eos)
    out, num = np.asarray(out), np.asarray(num)
    texts = []
    for row, n in zip(out, num):
        toks = [int(t) for t in row[:n] if t >= 0 and int(t) not in eos]
        texts.append(model.tokenizer.decode(toks, skip_special_tokens=True))
    return texts
