"""Model configuration for the Llama family (Llama 2/3/3.x, Mistral, Qwen2/2.5, Qwen3, SmolLM2).

One frozen, hashable dataclass describes every supported architecture, so it can be a static argument of a
jitted function. `ModelConfig.from_hf` reads a Hugging Face `config.json` dict (or a `transformers`
`PretrainedConfig`) and rejects anything this decoder does not implement, naming the value.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import math
import numbers
import os
from typing import Any, Mapping

import numpy as np

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")
SUPPORTED_ACTIVATIONS = ("silu", "swish")  # the same function in transformers' ACT2FN


class ConfigError(ValueError):
    """A checkpoint's configuration that this library cannot run."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters.

    Attributes:
      theta: base of the rotary frequencies.
      rope_type: "default", "llama3" (Llama 3.1 frequency scaling) or "linear" (position interpolation).
      factor: scaling factor for "llama3" / "linear".
      low_freq_factor, high_freq_factor, original_max_position: "llama3" parameters.
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self):
        # theta <= 0 or a factor of 0 gives NaN / infinite frequencies, and llama3's low_freq_factor >= high_freq_factor
        # divides by zero (or inverts its band): each would load and run with wrong positions.
        for name in ("theta", "factor", "low_freq_factor", "high_freq_factor"):
            value = getattr(self, name)
            if not _is_number(value) or not 0 < value < math.inf:
                raise ConfigError(f"rope {name}={value!r}: expected a positive finite number")
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(f"rope_type={self.rope_type!r} is not supported; expected one of {SUPPORTED_ROPE_TYPES}")
        mp = self.original_max_position
        if not _is_count(mp):
            raise ConfigError(f"rope original_max_position_embeddings={mp!r}: expected a positive integer")
        if self.rope_type == "llama3" and not self.low_freq_factor < self.high_freq_factor:
            raise ConfigError(f"rope low_freq_factor={self.low_freq_factor} and high_freq_factor="
                              f"{self.high_freq_factor}: llama3 scaling expects low_freq_factor < high_freq_factor")


def _is_number(value) -> bool:
    """A real number (Python or numpy), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_count(value, minimum: int = 1) -> bool:
    """A Python int (not a bool) >= minimum."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static description of a Llama-family decoder.

    Attributes:
      architecture: one of SUPPORTED_ARCHITECTURES ("llama" also covers SmolLM2).
      vocab_size, hidden_size (E), intermediate_size (F), num_layers (L).
      num_heads (Hq), num_kv_heads (Hkv), head_dim (D).
      qkv_bias: q/k/v projections carry a bias (Qwen2).
      o_bias / mlp_bias: output projection / MLP carry biases (Llama's and Qwen3's `attention_bias`, `mlp_bias`).
      qk_norm: RMSNorm over head_dim on q and k before RoPE (Qwen3).
      tie_word_embeddings: the LM head is the transposed embedding (SmolLM2, Llama 3.2).
      max_position_embeddings: the longest context the checkpoint was trained for.
      sliding_window: W, the window of the layers that use sliding-window attention (query i sees key j iff
        i - W < j <= i, as transformers), or None when no layer does.
      layer_windows: per layer, W for a sliding-window layer and 0 for full attention (length L), or () when no
        layer is windowed. Given `sliding_window` and no `layer_windows`, every layer is windowed (Mistral).
      bos_token_id / eos_token_ids: special tokens (several EOS ids are allowed).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope: RopeConfig = RopeConfig()
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    sliding_window: int | None = None
    layer_windows: tuple[int, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not _is_count(value):
                raise ConfigError(f"{name}={value!r}: expected a positive integer")
        for name, ids in (("bos_token_id", () if self.bos_token_id is None else (self.bos_token_id,)),
                          ("eos_token_ids", self.eos_token_ids)):
            if not all(_is_count(i, 0) for i in ids):
                raise ConfigError(f"{name}={getattr(self, name)!r}: expected non-negative integer token ids")
        mp = self.max_position_embeddings
        if not _is_count(mp):
            raise ConfigError(f"max_position_embeddings={mp!r}: expected a positive integer")
        eps = self.rms_norm_eps
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0 < eps < float("inf"):
            raise ConfigError(f"rms_norm_eps={eps!r}: expected a positive finite number")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(f"architecture {self.architecture!r} is not supported; expected one of "
                              f"{SUPPORTED_ARCHITECTURES}")
        self._normalise_windows()

    def _normalise_windows(self) -> None:
        W, L = self.sliding_window, self.num_layers
        windows = tuple(int(w) for w in self.layer_windows)
        if W is not None and not _is_count(W):
            raise ConfigError(f"sliding_window={W!r}: expected a positive number of tokens or None")
        if W is None:
            if any(windows):
                raise ConfigError(f"layer_windows={self.layer_windows} without a sliding_window: expected all 0")
            windows = ()
        elif not windows:
            windows = (W,) * L
        if windows:
            if len(windows) != L:
                raise ConfigError(f"layer_windows has {len(windows)} entries: expected one per layer "
                                  f"(num_layers={L})")
            bad = [w for w in windows if w not in (0, W)]
            if bad:
                raise ConfigError(f"layer_windows={windows}: expected 0 (full attention) or "
                                  f"sliding_window={W} per layer")
            if not any(windows):
                windows, W = (), None
        object.__setattr__(self, "layer_windows", windows)
        object.__setattr__(self, "sliding_window", W)

    @property
    def group_size(self) -> int:
        """G = Hq / Hkv, the number of query heads sharing one KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def windows(self) -> np.ndarray:
        """i32[L]: each layer's attention window in tokens, 0 for full attention (the layer scan's `xs`)."""
        return np.asarray(self.layer_windows or (0,) * self.num_layers, np.int32)

    @property
    def window_size(self) -> int | None:
        """W shared by the sliding-window layers, or None when every layer attends to the full context."""
        return self.sliding_window if self.layer_windows else None

    @property
    def every_layer_windowed(self) -> bool:
        """True when every layer uses the sliding window (Mistral), False when some or none do."""
        return bool(self.layer_windows) and all(self.layer_windows)

    def num_params(self) -> int:
        """Parameter count (embeddings and LM head included, and every bias and q/k norm the config enables: the
        element count of `models.params.expected_shapes`)."""
        e, f, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = e * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        extra = (self.qkv_bias * d * (self.num_heads + 2 * self.num_kv_heads) + self.o_bias * e
                 + self.mlp_bias * (2 * f + e) + self.qk_norm * 2 * d)
        layer = attn + 3 * e * f + 2 * e + extra
        head = 0 if self.tie_word_embeddings else self.vocab_size * e
        return self.num_layers * layer + self.vocab_size * e + head + e

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if not self.layer_windows:  # a model without windows keeps the dict (and fingerprint) it had before
            del d["layer_windows"]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        d = dict(d)
        d["rope"] = RopeConfig(**d["rope"])
        d["eos_token_ids"] = tuple(d["eos_token_ids"])
        d["layer_windows"] = tuple(d.get("layer_windows", ()))
        return cls(**d)

    @classmethod
    def from_hf(cls, hf: Any, where: str | None = None) -> "ModelConfig":
        """Builds a config from a Hugging Face config dict, `PretrainedConfig` or config.json path (`where`: the
        file a dict was read from, for messages).

        A key the config leaves out means what it means to transformers (its config class's default; e.g.
        Mistral's sliding window of 4096); a config without one of REQUIRED_HF_KEYS, or not a JSON object, is a
        ConfigError naming the file."""
        where = where or "config"
        if isinstance(hf, (str, os.PathLike)):
            where = str(hf)
            with open(hf, "rb") as f:
                try:
                    hf = json.load(f)
                except ValueError as e:  # JSONDecodeError, or UnicodeDecodeError for a binary file
                    raise ConfigError(f"{where} is not valid JSON: {e}") from None
        elif not isinstance(hf, Mapping) and hasattr(hf, "to_dict"):
            hf = hf.to_dict()
        if not isinstance(hf, Mapping):
            raise ConfigError(f"{where} holds a {type(hf).__name__}: expected a JSON object (a Hugging Face config)")
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(f"unknown architecture model_type={model_type!r} (architectures="
                              f"{hf.get('architectures')}); supported: {SUPPORTED_ARCHITECTURES}")
        missing = [k for k in REQUIRED_HF_KEYS if hf.get(k) is None]
        if missing:
            raise ConfigError(f"{where} lacks {', '.join(map(repr, missing))}: a {model_type} config needs "
                              f"{', '.join(REQUIRED_HF_KEYS)} (the weights' shapes)")
        hf = {**_class_defaults(model_type), **hf}  # a key left out means what it means to transformers
        try:
            return cls._from_hf_dict(hf, model_type)
        except ConfigError as e:  # every message names the file
            raise ConfigError(f"{where}: {e}") from None

    @classmethod
    def _from_hf_dict(cls, hf: Mapping[str, Any], model_type: str) -> "ModelConfig":
        for key in REQUIRED_HF_KEYS + ("num_key_value_heads", "head_dim"):
            value = hf.get(key)  # null: what transformers derives (the KV heads, the head size), else a size
            if value is not None and not _is_count(value):
                raise ConfigError(f"{key}={value!r}: expected a positive integer")
        num_heads = hf["num_attention_heads"]
        hidden = hf["hidden_size"]
        head_dim = hf.get("head_dim")
        # transformers' LlamaConfig refuses such a hidden_size; without a head_dim the others would floor it.
        if hidden % num_heads and (head_dim is None or model_type == "llama"):
            raise ConfigError(f"hidden_size={hidden} is not a multiple of num_attention_heads={num_heads}: expected a "
                              + ("multiple (transformers' LlamaConfig requires one)" if model_type == "llama"
                                 else "multiple, or an explicit head_dim"))
        head_dim = head_dim or hidden // num_heads
        eos = hf.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        sliding, layer_windows = _windows_from_hf(hf, model_type)
        act = hf.get("hidden_act", "silu")
        if act not in SUPPORTED_ACTIVATIONS:
            raise ConfigError(f"hidden_act={act!r}: this decoder implements the SwiGLU MLP only; expected one of "
                              f"{SUPPORTED_ACTIVATIONS}")
        return cls(
            architecture=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=num_heads if hf.get("num_key_value_heads") is None else hf["num_key_value_heads"],
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope=_rope_from_hf(hf),
            # transformers reads attention_bias for Llama and Qwen3 only (Qwen2 has q/k/v biases always, Mistral
            # none) and mlp_bias for Llama only: a flag another architecture ignores is ignored here too.
            qkv_bias=model_type == "qwen2" or (model_type in ("llama", "qwen3") and _flag(hf, "attention_bias")),
            o_bias=model_type in ("llama", "qwen3") and _flag(hf, "attention_bias"),
            mlp_bias=model_type == "llama" and _flag(hf, "mlp_bias"),
            qk_norm=model_type == "qwen3",
            tie_word_embeddings=_flag(hf, "tie_word_embeddings"),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            sliding_window=sliding,
            layer_windows=layer_windows,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos,
        )


# The keys a config must give (their transformers defaults are one model's shapes, never another checkpoint's).
REQUIRED_HF_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# The optional keys `from_hf` reads; one a config leaves out takes the default of the architecture's transformers
# config class (`_class_defaults`), e.g. Mistral's sliding_window 4096, Llama's 2048-token context, Qwen3's
# head_dim 128, Qwen2's 32 KV heads.
_OPTIONAL_HF_KEYS = ("num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "sliding_window",
                     "use_sliding_window", "max_window_layers", "tie_word_embeddings", "hidden_act",
                     "attention_bias", "mlp_bias")


def _flag(hf: Mapping[str, Any], key: str) -> bool:
    """A boolean key (absent or null: false); a string such as "false" is refused, not read as true."""
    value = hf.get(key)
    if value is not None and not isinstance(value, bool):
        raise ConfigError(f"{key}={value!r}: expected true or false")
    return bool(value)


@functools.lru_cache(maxsize=None)
def _class_defaults(model_type: str) -> dict[str, Any]:
    """The values transformers gives the keys of _OPTIONAL_HF_KEYS a config.json of `model_type` leaves out: the
    defaults of its config class's __init__ (None where transformers derives the value, e.g. Llama's head_dim)."""
    from transformers import CONFIG_MAPPING

    params = inspect.signature(CONFIG_MAPPING[model_type].__init__).parameters
    return {k: params[k].default for k in _OPTIONAL_HF_KEYS
            if k in params and params[k].default is not inspect.Parameter.empty}


def _windows_from_hf(hf: Mapping[str, Any], model_type: str) -> tuple[int | None, tuple[int, ...]]:
    """(sliding_window, layer_windows) as transformers applies them.

    Mistral: `sliding_window` (when not None) on every layer. Qwen2/Qwen3: only with `use_sliding_window`, on the
    layers `layer_types` marks "sliding_attention", or, without `layer_types`, on layers i >= `max_window_layers`.
    Llama: no window.
    """
    W = hf.get("sliding_window")
    L = hf["num_hidden_layers"]
    if model_type == "llama" or W is None:
        return None, ()
    if not _is_count(W):
        raise ConfigError(f"sliding_window={W!r}: expected a positive number of tokens or null")
    if model_type == "mistral":
        return W, (W,) * L
    if not _flag(hf, "use_sliding_window"):
        return None, ()
    types = hf.get("layer_types")
    if types is not None:
        if not isinstance(types, list):
            raise ConfigError(f"layer_types={types!r}: expected a list with one entry per layer")
        if len(types) != L:
            raise ConfigError(f"layer_types has {len(types)} entries: expected num_hidden_layers={L}")
        unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ConfigError(f"layer_types {unknown} are not supported; expected 'full_attention' or "
                              "'sliding_attention'")
        windows = tuple(W if t == "sliding_attention" else 0 for t in types)
    else:
        first = hf.get("max_window_layers", 28)  # transformers' default
        if not _is_count(first, 0):
            raise ConfigError(f"max_window_layers={first!r}: expected a non-negative number of layers")
        windows = tuple(W if i >= first else 0 for i in range(L))
    return (W, windows) if any(windows) else (None, ())


def _rope_from_hf(hf: Mapping[str, Any]) -> RopeConfig:
    # transformers 5 keeps theta and scaling in `rope_parameters`; older configs use rope_theta/rope_scaling.
    # transformers 5 lets a non-empty rope_scaling replace rope_parameters outright (theta included): a config saved
    # by it (rope_parameters of type default) with a rope_scaling added by hand runs the scaling there. Both are
    # read here and must agree; a disagreement is refused by name rather than resolved by either rule.
    for key in ("rope_parameters", "rope_scaling"):
        if hf.get(key) is not None and not isinstance(hf[key], Mapping):
            raise ConfigError(f"{key}={hf[key]!r}: expected a JSON object (or null)")
    params = dict(hf.get("rope_parameters") or {})
    nested = sorted(k for k, v in params.items() if isinstance(v, Mapping))
    if nested:
        raise ConfigError(f"rope_parameters per layer type ({nested}) are not supported; expected one set of "
                          "RoPE parameters for every layer")
    scaling = dict(hf.get("rope_scaling") or {})
    if params and scaling:
        top_theta = hf.get("rope_theta") if hf.get("rope_theta") is not None else 10000.0

        def norm(d):  # theta as each would be read (its own, else the top-level one, else 10000): compared too
            d = {("rope_type" if k == "type" else k): v for k, v in d.items()}
            d["rope_theta"] = float(d.get("rope_theta", top_theta))
            return {k: v for k, v in d.items() if not (k == "rope_type" and v == "default")}  # absent = default
        if norm(params) != norm(scaling):
            raise ConfigError(f"rope_scaling={scaling} (theta {norm(scaling)['rope_theta']:g}) and "
                              f"rope_parameters={params} (theta {norm(params)['rope_theta']:g}) disagree: expected one "
                              "of them (transformers 5 lets rope_scaling replace rope_parameters, theta included); "
                              "remove the one the checkpoint was not trained with")
    params = {**scaling, **params}

    def number(key, default):  # null as absent (a type that needs the key was checked for it above)
        value = default if params.get(key) is None else params[key]
        if not _is_number(value):
            raise ConfigError(f"rope {key}={value!r}: expected a number")
        return float(value)
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    if not _is_number(theta):
        raise ConfigError(f"rope_theta={theta!r}: expected a positive number")
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"rope_type={rope_type!r} is not supported; expected one of {SUPPORTED_ROPE_TYPES}")
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if rope_type != "default" and partial is not None and float(partial) != 1.0:
        # transformers' default RoPE of these architectures ignores the factor (as here); its scaled types build
        # frequencies for part of the head and then fail in the forward.
        raise ConfigError(f"partial_rotary_factor={partial} with rope_type={rope_type!r} is not supported; expected "
                          "1 (every head dimension rotated)")
    # The fields a scaled type reads are required, as transformers requires them (no made-up defaults); llama3's
    # original context as transformers takes it: the top-level field first, then the scaling's, then the context.
    needed = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor")}.get(rope_type, ())
    missing = [k for k in needed if params.get(k) is None]
    if missing:
        raise ConfigError(f"rope_type={rope_type!r} needs {', '.join(missing)} in rope_scaling / rope_parameters; "
                          "the config has none")
    original = 8192  # unused by the default and linear types (kept as it was: the field enters the fingerprint)
    if rope_type == "llama3":
        original = hf.get("original_max_position_embeddings") or params.get("original_max_position_embeddings") or \
            hf.get("max_position_embeddings") or 8192
        if not _is_number(original) or original != int(original):
            raise ConfigError(f"rope original_max_position_embeddings={original!r}: expected a positive integer")
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=number("factor", 1.0),
        low_freq_factor=number("low_freq_factor", 1.0),
        high_freq_factor=number("high_freq_factor", 4.0),
        original_max_position=int(original),
    )
