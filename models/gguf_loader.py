"""GGUF files (llama.cpp) -> `(ModelConfig, Params)`, dequantized with the `gguf` package in numpy.

The config comes from the GGUF metadata (`{arch}.block_count`, `embedding_length`, `feed_forward_length`,
`attention.head_count(_kv)`, `rope.freq_base`, `attention.layer_norm_rms_epsilon`, `context_length`, ...); the
vocabulary size from the embedding (the token list when the embedding is absent); the embedding is tied when
`output.weight` is absent. Tensors are renamed to their Hugging Face names (`GGUF_TO_HF`) and converted with the
same key table as Hugging Face checkpoints (`models.convert.HF_KEY_MAP`).

llama.cpp's `convert_hf_to_gguf.py` permutes the rows of Llama's Q and K projections so that its interleaved
("GPT-J style") RoPE computes what the Hugging Face rotate-half RoPE computes:

  permute(w, H):   w.reshape(H, 2, D/2, E).swapaxes(1, 2).reshape(H*D, E)

`unpermute_qk` undoes it (as transformers' `LlamaTensorProcessor._reverse_permute_weights` does), so the
rotate-half RoPE of `models.llama` applies unchanged. Qwen2/Qwen3 GGUFs use NEOX RoPE and are not permuted.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from models.config import ConfigError, ModelConfig, RopeConfig
from models.convert import TensorSource, convert_tensors
from models.llama import rope_inv_freq
from models.params import Params

GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")
_PERMUTED_ARCHITECTURES = ("llama",)

# GGUF tensor name -> Hugging Face tensor name ("{i}" is the layer).
GGUF_TO_HF = (
    (r"token_embd\.weight", "model.embed_tokens.weight"),
    (r"output_norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"blk\.(\d+)\.attn_norm\.weight", "model.layers.{i}.input_layernorm.weight"),
    (r"blk\.(\d+)\.ffn_norm\.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.attn_q\.(weight|bias)", "model.layers.{i}.self_attn.q_proj.{p}"),
    (r"blk\.(\d+)\.attn_k\.(weight|bias)", "model.layers.{i}.self_attn.k_proj.{p}"),
    (r"blk\.(\d+)\.attn_v\.(weight|bias)", "model.layers.{i}.self_attn.v_proj.{p}"),
    (r"blk\.(\d+)\.attn_output\.(weight|bias)", "model.layers.{i}.self_attn.o_proj.{p}"),
    (r"blk\.(\d+)\.attn_q_norm\.weight", "model.layers.{i}.self_attn.q_norm.weight"),
    (r"blk\.(\d+)\.attn_k_norm\.weight", "model.layers.{i}.self_attn.k_norm.weight"),
    (r"blk\.(\d+)\.ffn_gate\.(weight|bias)", "model.layers.{i}.mlp.gate_proj.{p}"),
    (r"blk\.(\d+)\.ffn_up\.(weight|bias)", "model.layers.{i}.mlp.up_proj.{p}"),
    (r"blk\.(\d+)\.ffn_down\.(weight|bias)", "model.layers.{i}.mlp.down_proj.{p}"),
)
# Read into the config (rope_freqs: Llama 3.1 frequency factors), not into params.
_CONFIG_TENSORS = ("rope_freqs.weight",)
_GGUF_COMPILED = tuple((re.compile(p), t) for p, t in GGUF_TO_HF)


def gguf_to_hf_name(name: str) -> str | None:
    """The Hugging Face name of GGUF tensor `name`, or None if it has none."""
    for rx, template in _GGUF_COMPILED:
        m = rx.fullmatch(name)
        if m:
            groups = m.groups()
            return template.format(i=groups[0] if groups else "", p=groups[1] if len(groups) > 1 else "")
    return None


def permute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """HF -> llama.cpp row order (what convert_hf_to_gguf.py does). w: [H*D, ...] or [H*D]."""
    d = w.shape[0] // num_heads
    return w.reshape(num_heads, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp -> HF row order (inverse of `permute_qk`). w: [H*D, ...] or [H*D]."""
    d = w.shape[0] // num_heads
    return w.reshape(num_heads, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def open_gguf(path: str | os.PathLike):
    """A `gguf.GGUFReader` for `path`; a missing file is FileNotFoundError, an unreadable one ValueError."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the gguf package raises ValueError, struct/IndexError, OSError... on bad files
        raise ValueError(f"{path}: not a readable GGUF file (corrupt or truncated?): "
                         f"{type(e).__name__}: {e}") from e


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    value = f.contents()
    return value


def _count(reader, key: str, path, default=None) -> int | None:
    """The positive integer metadata value `key` (a count or a size), `default` when absent; another value (0, a
    string, a per-layer array) is a ValueError naming the key, not a ZeroDivisionError or a guess later."""
    value = _field(reader, key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{path}: GGUF metadata {key}={value!r}: expected a positive integer")
    return int(value)


def _number(reader, key: str, path, default=None) -> float | None:
    """The real-number metadata value `key` (`default` when absent); a string or an array is named."""
    value = _field(reader, key, default)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float, np.number))):
        raise ValueError(f"{path}: GGUF metadata {key}={value!r}: expected a number")
    return None if value is None else float(value)


class GGUFSource(TensorSource):
    """A GGUF file's tensors under their Hugging Face names, dequantized to f32 on read."""

    def __init__(self, reader, path: Path):
        self._path = path
        self._tensors = {}
        self.extra = {}
        for t in reader.tensors:
            hf = gguf_to_hf_name(t.name)
            if hf is None:
                if t.name in _CONFIG_TENSORS:
                    self.extra[t.name] = t
                    continue
                raise ValueError(f"{path}: GGUF tensor {t.name!r} is not part of a decoder this library "
                                 "implements (unknown tensor)")
            self._tensors[hf] = t

    def keys(self):
        return self._tensors.keys()

    def shape(self, name):
        # GGUF stores dims fastest-first (ne); numpy order is reversed.
        return tuple(int(n) for n in reversed(self._tensors[name].shape.tolist()))

    def get(self, name):
        return dequantize(self._tensors[name], self._path)


def dequantize(tensor, path: Path) -> np.ndarray:
    """f32 numpy array of a GGUF tensor in numpy dim order."""
    from gguf.quants import dequantize as _dequantize

    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    try:
        w = _dequantize(tensor.data, tensor.tensor_type)
        # A copy: an F32 tensor comes back as a view of the memory-mapped file, which a rewrite of the file would
        # change under the loaded model (and a truncation turn into SIGBUS).
        return np.array(w, np.float32, copy=True).reshape(shape)
    except NotImplementedError as e:  # the gguf package does not dequantize this type
        raise ValueError(f"{path}: GGUF tensor {tensor.name!r} has type {tensor.tensor_type.name}, which the gguf "
                         f"package cannot dequantize ({e}); expected F32, F16, BF16 or a type it reads (Q8_0, Q4_0, "
                         "Q4_1, Q5_0, Q5_1, the K-quants ...)") from e
    except Exception as e:
        raise ValueError(f"{path}: GGUF tensor {tensor.name!r} ({tensor.tensor_type.name}, shape {shape}) "
                         f"cannot be read (corrupt or truncated file?): {type(e).__name__}: {e}") from e


def config_from_gguf(reader, path: str | os.PathLike = "gguf") -> ModelConfig:
    """Builds a ModelConfig from a GGUF reader's metadata and tensor list."""
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ConfigError(f"{path}: GGUF architecture general.architecture={arch!r} is not supported; "
                          f"expected one of {GGUF_ARCHITECTURES}")
    names = {t.name: t for t in reader.tensors}

    def need(key):
        value = _count(reader, f"{arch}.{key}", path)
        if value is None:
            raise ValueError(f"{path}: GGUF metadata key {arch}.{key!r} is missing")
        return value

    hidden = need("embedding_length")
    num_heads = need("attention.head_count")
    num_kv_heads = _count(reader, f"{arch}.attention.head_count_kv", path, num_heads)
    # As llama.cpp: the head size from attention.key_length (default hidden / heads); rope.dimension_count is how
    # many of its dimensions RoPE rotates (default all of them), which must be all here.
    head_dim = _count(reader, f"{arch}.attention.key_length", path)
    if head_dim is None:
        if hidden % num_heads:
            raise ValueError(f"{path}: GGUF {arch}.embedding_length={hidden} is not a multiple of "
                             f"{arch}.attention.head_count={num_heads} and no {arch}.attention.key_length gives the "
                             "head size; expected one of them")
        head_dim = hidden // num_heads
    n_rot = _count(reader, f"{arch}.rope.dimension_count", path)
    if n_rot is not None and n_rot != head_dim:  # llama.cpp refuses it for llama, rotates part for qwen
        raise ConfigError(f"{path}: GGUF {arch}.rope.dimension_count={int(n_rot)}: this model rotates every dimension "
                          f"of a head; expected head_dim={head_dim}")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if "token_embd.weight" in names:
        vocab = int(names["token_embd.weight"].shape[-1])
        if tokens is not None and len(tokens) != vocab:  # ids past the embedding would read its last row
            raise ValueError(f"{path}: tokenizer.ggml.tokens holds {len(tokens)} tokens, but token_embd.weight has "
                             f"{vocab} rows; expected one row per token (llama.cpp refuses such a file too)")
    else:
        if tokens is None:
            raise ValueError(f"{path}: neither token_embd.weight nor tokenizer.ggml.tokens gives a vocab size")
        vocab = len(tokens)
    theta = _number(reader, f"{arch}.rope.freq_base", path, 10000.0)
    if not 0 < theta < float("inf"):  # NaN or infinite frequencies
        raise ConfigError(f"{path}: GGUF metadata {arch}.rope.freq_base={theta!r}: expected a positive finite number")
    rope = RopeConfig(theta=theta)
    # As llama.cpp reads them: the factor from rope.scaling.factor or the older rope.scale_linear, the type
    # "linear" when the file names none (a factor of 0 or 1 scales nothing).
    factor = _number(reader, f"{arch}.rope.scaling.factor", path)
    if factor is None:
        factor = _number(reader, f"{arch}.rope.scale_linear", path)
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling is None:
        scaling = "none" if factor is None or float(factor) in (0.0, 1.0) else "linear"
    if scaling == "linear":
        if factor is None:
            raise ValueError(f"{path}: GGUF metadata key {arch}.rope.scaling.factor is missing (rope scaling type "
                             "'linear')")
        if factor < 0:
            raise ConfigError(f"{path}: GGUF rope scaling factor {factor}: expected a positive factor (or 0: none)")
        if float(factor) not in (0.0, 1.0):
            rope = RopeConfig(theta=theta, rope_type="linear", factor=float(factor))
    elif scaling != "none":
        raise ConfigError(f"{path}: GGUF rope scaling {arch}.rope.scaling.type={scaling!r} is not supported; "
                          "expected 'none' or 'linear'")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    try:
        cfg = ModelConfig(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=need("feed_forward_length"),
            num_layers=need("block_count"),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_number(reader, f"{arch}.attention.layer_norm_rms_epsilon", path, 1e-5),
            rope=rope,
            qkv_bias="blk.0.attn_q.bias" in names,
            o_bias="blk.0.attn_output.bias" in names,
            mlp_bias="blk.0.ffn_gate.bias" in names,
            qk_norm="blk.0.attn_q_norm.weight" in names,
            tie_word_embeddings="output.weight" not in names,
            max_position_embeddings=_count(reader, f"{arch}.context_length", path, 4096),
            sliding_window=None,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=() if eos is None else (int(eos),),
        )
    except ConfigError as e:  # a value ModelConfig refuses (rms_norm_eps 0, KV heads not dividing the heads...)
        raise ConfigError(f"{path}: GGUF metadata gives {e}") from None
    if "rope_freqs.weight" in names:
        cfg = _with_llama3_rope(cfg, reader, names["rope_freqs.weight"], path)
    return cfg


def _with_llama3_rope(cfg: ModelConfig, reader, tensor, path) -> ModelConfig:
    """Recognises llama.cpp's `rope_freqs` (per-frequency divisors) as Llama 3.1 scaling, or raises."""
    import dataclasses

    factors = dequantize(tensor, Path(path)).reshape(-1)
    if factors.shape != (cfg.head_dim // 2,):
        raise ValueError(f"{path}: rope_freqs.weight has {factors.shape[0]} entries, expected head_dim/2="
                         f"{cfg.head_dim // 2}")
    arch = cfg.architecture
    original = int(_field(reader, f"{arch}.rope.scaling.original_context_length", 8192))
    rope = RopeConfig(theta=cfg.rope.theta, rope_type="llama3", factor=float(factors.max()), low_freq_factor=1.0,
                      high_freq_factor=4.0, original_max_position=original)
    candidate = dataclasses.replace(cfg, rope=rope)
    base = 1.0 / (cfg.rope.theta ** (np.arange(0, cfg.head_dim, 2, dtype=np.float32) / cfg.head_dim))
    if not np.allclose(rope_inv_freq(candidate), base / factors, rtol=1e-4):
        raise ConfigError(f"{path}: rope_freqs.weight holds frequency factors that are not Llama 3.1 scaling "
                          f"(factor={factors.max()}, low 1, high 4, original {original}); not supported")
    return candidate


def load_gguf(path: str | os.PathLike, dtype=jnp.float32, mesh=None, reader=None) -> tuple[ModelConfig, Params]:
    """Loads and dequantizes a GGUF file.

    Args:
      path: a .gguf file (llama / qwen2 / qwen3 architectures; any quantization `gguf` can dequantize).
      dtype: dtype of the returned params.
      mesh: None, or a `jax.sharding.Mesh` to place each tensor on from the host (`models.sharding.placer`).
      reader: `open_gguf(path)` already made (parsing the file's metadata takes seconds: SmolLM2's 49K-token
        vocabulary), or None to open it here.

    Returns:
      (cfg, params) with params in the layout of `models.params` (Q/K rows restored to Hugging Face order).

    Raises:
      FileNotFoundError: the file does not exist.
      ValueError: the file is corrupt or truncated, or a tensor is missing / misshapen (the file is named).
      ConfigError: the architecture or rope scaling is not supported.
    """
    path = Path(path)
    reader = open_gguf(path) if reader is None else reader
    try:
        cfg = config_from_gguf(reader, path)
    except (ConfigError, ValueError):
        raise
    except Exception as e:
        raise ValueError(f"{path}: GGUF metadata cannot be read: {type(e).__name__}: {e}") from e
    source = GGUFSource(reader, path)
    transform = None
    if cfg.architecture in _PERMUTED_ARCHITECTURES:
        def transform(name, w):
            if ".self_attn.q_proj." in name:
                return unpermute_qk(w, cfg.num_heads)
            if ".self_attn.k_proj." in name:
                return unpermute_qk(w, cfg.num_kv_heads)
            return w
    place = None
    if mesh is not None:
        from models.sharding import placer
        place = placer(cfg, mesh)
    return cfg, convert_tensors(cfg, source, dtype, where=str(path), transform=transform, place=place)
