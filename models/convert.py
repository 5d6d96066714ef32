"""Hugging Face checkpoints -> `(ModelConfig, Params)` in the layout of `models.params`.

Conversion is one table of regex key maps (as in jax-llm-examples' llama3): each Hugging Face tensor name maps to
a field of `Params` / `LayerParams`, the shape Hugging Face stores it in (a function of the config, asserted for
every tensor before it is read) and a reshape into our layout:

  q_proj.weight [Hq*D, E]  -> wq [E, Hq, D]        k_proj / v_proj [Hkv*D, E] -> wk / wv [E, Hkv, D]
  o_proj.weight [E, Hq*D]  -> wo [Hq, D, E]        gate_proj / up_proj [F, E] -> w_gate / w_up [E, F]
  down_proj.weight [E, F]  -> w_down [F, E]        lm_head.weight [V, E]      -> lm_head [E, V] (absent when tied)
  q_proj.bias [Hq*D]       -> bq [Hq, D]           q_norm / k_norm [D]         (Qwen3)

Per-layer tensors are stacked on a leading axis L. Weights are read with the `safetensors` numpy API (bf16
through a raw memory map, since numpy has no bf16 of its own); nothing is unpickled and no remote code runs.
The GGUF reader (`models.gguf_loader`) renames GGUF tensors to these Hugging Face names and reuses the table.

  load_hf_folder(path, dtype) -> (cfg, params)       config.json + model.safetensors (or a sharded index)
  from_transformers(model, dtype) -> (cfg, params)    an in-memory `transformers` model
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Callable, Iterable, Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from models.config import ConfigError, ModelConfig
from models.params import LayerParams, Params, Slice, check_shapes, projection_views

ShapeFn = Callable[[ModelConfig], tuple[int, ...]]
Reshape = Callable[[np.ndarray, ModelConfig], np.ndarray]


@dataclasses.dataclass(frozen=True)
class KeyMap:
    """One row of the conversion table.

    Attributes:
      pattern: regex over the Hugging Face tensor name; group 1 (if any) is the layer index.
      target: field of `Params` ("embed", "final_norm", "lm_head") or of `LayerParams` ("layers.wq", ...).
      hf_shape: the shape Hugging Face stores the tensor in, for a given config.
      reshape: maps the Hugging Face array to our layout.
    """

    pattern: str
    target: str
    hf_shape: ShapeFn
    reshape: Reshape


def _same(x, cfg):
    return x


def _transpose(x, cfg):
    return x.T


def _heads_in(num_heads: Callable[[ModelConfig], int]) -> Reshape:
    """[H*D, E] -> [E, H, D]."""
    return lambda x, cfg: x.reshape(num_heads(cfg), cfg.head_dim, x.shape[-1]).transpose(2, 0, 1)


def _heads_bias(num_heads: Callable[[ModelConfig], int]) -> Reshape:
    """[H*D] -> [H, D]."""
    return lambda x, cfg: x.reshape(num_heads(cfg), cfg.head_dim)


def _heads_out(x, cfg):
    """[E, Hq*D] -> [Hq, D, E]."""
    return x.reshape(x.shape[0], cfg.num_heads, cfg.head_dim).transpose(1, 2, 0)


_HQ = lambda c: c.num_heads  # noqa: E731
_HKV = lambda c: c.num_kv_heads  # noqa: E731
_LAYER = r"model\.layers\.(\d+)\."

HF_KEY_MAP: tuple[KeyMap, ...] = (
    KeyMap(r"model\.embed_tokens\.weight", "embed", lambda c: (c.vocab_size, c.hidden_size), _same),
    KeyMap(r"model\.norm\.weight", "final_norm", lambda c: (c.hidden_size,), _same),
    KeyMap(r"lm_head\.weight", "lm_head", lambda c: (c.vocab_size, c.hidden_size), _transpose),
    KeyMap(_LAYER + r"input_layernorm\.weight", "layers.attn_norm", lambda c: (c.hidden_size,), _same),
    KeyMap(_LAYER + r"post_attention_layernorm\.weight", "layers.mlp_norm", lambda c: (c.hidden_size,), _same),
    KeyMap(_LAYER + r"self_attn\.q_proj\.weight", "layers.wq",
           lambda c: (c.num_heads * c.head_dim, c.hidden_size), _heads_in(_HQ)),
    KeyMap(_LAYER + r"self_attn\.k_proj\.weight", "layers.wk",
           lambda c: (c.num_kv_heads * c.head_dim, c.hidden_size), _heads_in(_HKV)),
    KeyMap(_LAYER + r"self_attn\.v_proj\.weight", "layers.wv",
           lambda c: (c.num_kv_heads * c.head_dim, c.hidden_size), _heads_in(_HKV)),
    KeyMap(_LAYER + r"self_attn\.o_proj\.weight", "layers.wo",
           lambda c: (c.hidden_size, c.num_heads * c.head_dim), _heads_out),
    KeyMap(_LAYER + r"self_attn\.q_proj\.bias", "layers.bq", lambda c: (c.num_heads * c.head_dim,),
           _heads_bias(_HQ)),
    KeyMap(_LAYER + r"self_attn\.k_proj\.bias", "layers.bk", lambda c: (c.num_kv_heads * c.head_dim,),
           _heads_bias(_HKV)),
    KeyMap(_LAYER + r"self_attn\.v_proj\.bias", "layers.bv", lambda c: (c.num_kv_heads * c.head_dim,),
           _heads_bias(_HKV)),
    KeyMap(_LAYER + r"self_attn\.o_proj\.bias", "layers.bo", lambda c: (c.hidden_size,), _same),
    KeyMap(_LAYER + r"self_attn\.q_norm\.weight", "layers.q_norm", lambda c: (c.head_dim,), _same),
    KeyMap(_LAYER + r"self_attn\.k_norm\.weight", "layers.k_norm", lambda c: (c.head_dim,), _same),
    KeyMap(_LAYER + r"mlp\.gate_proj\.weight", "layers.w_gate",
           lambda c: (c.intermediate_size, c.hidden_size), _transpose),
    KeyMap(_LAYER + r"mlp\.up_proj\.weight", "layers.w_up",
           lambda c: (c.intermediate_size, c.hidden_size), _transpose),
    KeyMap(_LAYER + r"mlp\.down_proj\.weight", "layers.w_down",
           lambda c: (c.hidden_size, c.intermediate_size), _transpose),
    KeyMap(_LAYER + r"mlp\.gate_proj\.bias", "layers.b_gate", lambda c: (c.intermediate_size,), _same),
    KeyMap(_LAYER + r"mlp\.up_proj\.bias", "layers.b_up", lambda c: (c.intermediate_size,), _same),
    KeyMap(_LAYER + r"mlp\.down_proj\.bias", "layers.b_down", lambda c: (c.hidden_size,), _same),
)

# Tensors a checkpoint may carry that the forward does not read.
IGNORED_KEYS = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq", r"model\.rotary_emb\.inv_freq")

_COMPILED = tuple((re.compile(m.pattern), m) for m in HF_KEY_MAP)
_IGNORED = tuple(re.compile(p) for p in IGNORED_KEYS)


def _wanted_targets(cfg: ModelConfig) -> dict[str, str]:
    """target -> Hugging Face name template ('{i}' for the layer) of every tensor `cfg` requires."""
    want = {}
    for m in HF_KEY_MAP:
        field = m.target.split(".")[-1]
        per_layer = m.target.startswith("layers.")
        if _required(cfg, field):
            name = m.pattern.replace(_LAYER, "model.layers.{i}.").replace("\\.", ".")
            want[m.target] = name if per_layer else name.replace("{i}", "")
    return want


def _required(cfg: ModelConfig, field: str) -> bool:
    if field == "lm_head":
        return not cfg.tie_word_embeddings
    if field in ("bq", "bk", "bv"):
        return cfg.qkv_bias
    if field == "bo":
        return cfg.o_bias
    if field in ("q_norm", "k_norm"):
        return cfg.qk_norm
    if field in ("b_gate", "b_up", "b_down"):
        return cfg.mlp_bias
    return True


class TensorSource:
    """A read-only mapping name -> array with shapes known before reading (a checkpoint, lazily)."""

    def keys(self) -> Iterable[str]:
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def get(self, name: str) -> np.ndarray:
        raise NotImplementedError


class DictSource(TensorSource):
    """Tensors already in memory (numpy arrays)."""

    def __init__(self, tensors: Mapping[str, np.ndarray]):
        self._t = tensors

    def keys(self):
        return self._t.keys()

    def shape(self, name):
        return tuple(self._t[name].shape)

    def get(self, name):
        return self._t[name]


def convert_tensors(cfg: ModelConfig, source: TensorSource, dtype=jnp.float32, *, where: str = "checkpoint",
                    transform: Callable[[str, np.ndarray], np.ndarray] | None = None,
                    place: Callable[[str, np.ndarray], jax.Array] | None = None) -> Params:
    """Converts Hugging Face-named tensors into `Params` for `cfg`.

    Args:
      cfg: the model's configuration (it decides which tensors must be present and their shapes).
      source: the tensors, by Hugging Face name.
      dtype: dtype of the returned arrays.
      where: the file or object the tensors come from (named in errors).
      transform: optional hook applied to each raw array (after the shape check) before the reshape.

    Returns:
      Params in the layout of `models.params`, every leaf a jax.Array of `dtype`.

    Raises:
      ValueError: a required tensor is missing, a tensor's shape disagrees with the config, or the checkpoint
        holds a tensor this decoder does not know (named).
    """
    np_dtype = jnp.dtype(dtype)
    per_layer: dict[str, dict[int, np.ndarray]] = {}
    top: dict[str, np.ndarray] = {}
    stored_head = None
    for name in source.keys():
        match = None
        for rx, m in _COMPILED:
            hit = rx.fullmatch(name)
            if hit:
                match = (hit, m)
                break
        if match is None:
            if any(rx.fullmatch(name) for rx in _IGNORED):
                continue
            raise ValueError(f"{where}: tensor {name!r} is not part of a {cfg.architecture} decoder this "
                             "library implements (unknown key)")
        hit, m = match
        field = m.target.split(".")[-1]
        if not _required(cfg, field):
            if field == "lm_head":  # some tied checkpoints store the (identical) head anyway: checked below
                stored_head = name
                continue
            raise ValueError(f"{where}: tensor {name!r} is present but config.json does not enable it "
                             f"({field} for architecture {cfg.architecture!r})")
        want = m.hf_shape(cfg)
        got = tuple(source.shape(name))
        if got != want:
            raise ValueError(f"{where}: tensor {name!r} has shape {got}, but the config implies {want}")
        raw = source.get(name)
        if not jnp.issubdtype(raw.dtype, jnp.floating):  # an integer or bool tensor would be cast, not refused
            raise ValueError(f"{where}: tensor {name!r} has dtype {raw.dtype}: expected a floating-point tensor")
        if transform is not None:
            raw = transform(name, raw)
        # Cast each tensor as it is read, so a large checkpoint is never held whole in f32.
        arr = np.asarray(m.reshape(raw, cfg)).astype(np_dtype, copy=False)
        if m.target.startswith("layers."):
            layer = int(hit.group(1))
            if not 0 <= layer < cfg.num_layers:
                raise ValueError(f"{where}: tensor {name!r} is for layer {layer}, but the config has "
                                 f"num_layers={cfg.num_layers} (valid 0..{cfg.num_layers - 1})")
            per_layer.setdefault(field, {})[layer] = arr
        else:
            top[field] = arr

    for target, template in _wanted_targets(cfg).items():
        field = target.split(".")[-1]
        if target.startswith("layers."):
            have = per_layer.get(field, {})
            missing = [i for i in range(cfg.num_layers) if i not in have]
            if missing:
                raise ValueError(f"{where}: tensor {template.format(i=missing[0])!r} is missing "
                                 f"({len(missing)} of {cfg.num_layers} layers lack {field})")
        elif field not in top:
            raise ValueError(f"{where}: tensor {template!r} is missing")

    if stored_head is not None:
        _check_tied_head(source, stored_head, top["embed"], np_dtype, transform, where)

    def put(name, x):
        if x is None:
            return None
        return jnp.asarray(x, dtype) if place is None else place(name, np.asarray(x).astype(np_dtype, copy=False))

    layer_fields = {f.name for f in dataclasses.fields(LayerParams)}
    layers = LayerParams(**{f: put(f"layers.{f}", np.stack([per_layer[f][i] for i in range(cfg.num_layers)]))
                            if f in per_layer else None for f in layer_fields})
    params = Params(embed=put("embed", top["embed"]), layers=layers, final_norm=put("final_norm", top["final_norm"]),
                    lm_head=put("lm_head", top.get("lm_head")))
    check_shapes(cfg, params, where)
    return params


def _check_tied_head(source: TensorSource, name: str, embed: np.ndarray, np_dtype, transform, where: str) -> None:
    """A tied checkpoint (tie_word_embeddings true) may store its output head too, but only as a copy of the
    embedding, which the model then uses: a stored head that differs would be silently replaced, so it is refused."""
    raw = source.get(name)  # Hugging Face stores the head [V, E], as the embedding
    if transform is not None:
        raw = transform(name, raw)
    head = np.asarray(raw).astype(np_dtype, copy=False)
    if head.shape != embed.shape or not np.array_equal(head, embed):
        diff = (f"max |difference| {float(np.max(np.abs(head.astype(np.float32) - embed.astype(np.float32)))):.3g}"
                if head.shape == embed.shape else f"shape {head.shape} against {embed.shape}")
        raise ValueError(f"{where}: config.json sets tie_word_embeddings=true (the output head is the embedding), "
                         f"but the checkpoint stores a different {name!r} ({diff}); expected no stored head or a "
                         "copy of the embedding. If the stored head is meant, set tie_word_embeddings to false in "
                         "config.json")


# ----------------------------------------------------------------------------------------------- safetensors


class SafetensorsSource(TensorSource):
    """One or more .safetensors files, read lazily with the safetensors numpy API.

    numpy has no bfloat16, so BF16 (and F8) tensors are read through a memory map of the file at the offsets the
    safetensors header gives and viewed as `ml_dtypes` types.
    """

    _RAW = {"BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}

    def __init__(self, files: Mapping[str, Path]):
        from safetensors import safe_open

        self._where: dict[str, Path] = {}
        self._meta: dict[Path, dict] = {}
        self._open: dict[Path, object] = {}
        for path in sorted(set(files.values())):
            if not path.is_file():
                raise FileNotFoundError(f"weight file {str(path)!r} does not exist")
            try:
                handle = safe_open(str(path), framework="numpy")
                self._open[path] = handle
                names = list(handle.keys())
            except Exception as e:  # safetensors raises its own SafetensorError
                raise ValueError(f"{path}: not a readable safetensors file ({e})") from e
            for name in names:
                self._where[name] = path
        for name, path in files.items():
            if name not in self._where:
                raise ValueError(f"{path}: the index lists tensor {name!r}, but the file does not hold it")

    def keys(self):
        return self._where.keys()

    def shape(self, name):
        return tuple(self._open[self._where[name]].get_slice(name).get_shape())

    def get(self, name):
        path = self._where[name]
        sl = self._open[path].get_slice(name)
        dtype = sl.get_dtype()
        if dtype in self._RAW:
            header = self._header(path)
            start, end = header[name]["data_offsets"]
            base = 8 + header["__len__"]
            raw = np.memmap(path, dtype=np.uint8, mode="r", offset=base + start, shape=(end - start,))
            return np.asarray(raw).view(self._RAW[dtype]).reshape(sl.get_shape())
        return self._open[path].get_tensor(name)

    def _header(self, path: Path) -> dict:
        if path not in self._meta:
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
            header["__len__"] = n
            self._meta[path] = header
        return self._meta[path]


def _weight_files(folder: Path) -> dict[str, Path]:
    """name -> file for model.safetensors or a sharded model.safetensors.index.json."""
    index = folder / "model.safetensors.index.json"
    single = folder / "model.safetensors"
    if index.is_file():
        with open(index, "rb") as f:
            try:
                meta = json.load(f)
            except ValueError as e:  # JSONDecodeError, or UnicodeDecodeError for a binary file
                raise ValueError(f"{index}: not valid JSON ({e})") from e
        if not isinstance(meta, dict):
            raise ValueError(f"{index} holds a {type(meta).__name__}: expected a JSON object with a 'weight_map'")
        weight_map = meta.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: no 'weight_map' in the sharded checkpoint index")
        bad = next(((k, v) for k, v in weight_map.items() if not isinstance(v, str) or not v), None)
        if bad is not None:
            raise ValueError(f"{index}: weight_map maps {bad[0]!r} to {bad[1]!r}: expected a shard file name")
        return {name: folder / shard for name, shard in weight_map.items()}
    if single.is_file():
        from safetensors import safe_open

        try:
            with safe_open(str(single), framework="numpy") as f:
                return {name: single for name in f.keys()}
        except Exception as e:
            raise ValueError(f"{single}: not a readable safetensors file ({e})") from e
    others = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
    hint = f" (found {others}: pickled checkpoints are not read; convert them to safetensors)" if others else ""
    raise FileNotFoundError(f"no weight file in {str(folder)!r}: expected {str(single)!r} or "
                            f"{str(index)!r}{hint}")


def load_hf_folder(path: str | os.PathLike, dtype=jnp.float32, mesh=None) -> tuple[ModelConfig, Params]:
    """Loads a Hugging Face checkpoint folder (config.json + safetensors weights).

    Args:
      path: folder holding config.json and model.safetensors or model.safetensors.index.json with its shards.
      dtype: dtype of the returned params (jnp.float32 or jnp.bfloat16).
      mesh: None, or a `jax.sharding.Mesh`: each tensor goes from the host straight to its shards
        (`models.sharding.placer`), no device holding a full copy of a sharded tensor.

    Returns:
      (cfg, params) with params in the layout of `models.params`.

    Raises:
      FileNotFoundError: the folder, config.json or a weight file does not exist (named).
      ConfigError: config.json names an architecture or RoPE type this library does not run.
      ValueError: a tensor is missing, unknown, or has a shape that disagrees with config.json (named).
    """
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {str(folder)!r} does not exist")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{str(config_path)!r} does not exist (a Hugging Face folder needs config.json)")
    with open(config_path, "rb") as f:
        try:
            hf = json.load(f)
        except ValueError as e:  # JSONDecodeError, or UnicodeDecodeError for a binary file
            raise ConfigError(f"{config_path}: not valid JSON ({e})") from e
    cfg = ModelConfig.from_hf(hf, where=str(config_path))
    source = SafetensorsSource(_weight_files(folder))
    return cfg, convert_tensors(cfg, source, dtype, where=str(folder), place=_placer(cfg, mesh))


def _placer(cfg: ModelConfig, mesh):
    if mesh is None:
        return None
    from models.sharding import placer
    return placer(cfg, mesh)


def _torch_to_numpy(t) -> np.ndarray:
    import torch

    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def from_transformers(model, dtype=jnp.float32) -> tuple[ModelConfig, Params]:
    """Converts an in-memory `transformers` causal LM (Llama, Mistral, Qwen2, Qwen3) with the same key table.

    Args:
      model: e.g. a `LlamaForCausalLM`; its `config` and `state_dict()` are read.
      dtype: dtype of the returned params.
    """
    cfg = ModelConfig.from_hf(model.config)
    tensors = {name: _torch_to_numpy(t) for name, t in model.state_dict().items()}
    return cfg, convert_tensors(cfg, DictSource(tensors), dtype, where=type(model).__name__)


def params_to_numpy(params: Params) -> dict[str, np.ndarray]:
    """Flattens params to {"embed": ..., "layers.wq": ...} numpy arrays (absent leaves omitted), always in the
    separate q/k/v and gate/up layout (fused params are split, `models.params.projection_views`)."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(projection_views(params)):
        name = ".".join(str(getattr(k, "name", k)) for k in path)
        out[name] = np.asarray(leaf.get() if isinstance(leaf, Slice) else leaf)
    return out


def params_from_numpy(cfg: ModelConfig, arrays: Mapping[str, np.ndarray], dtype=jnp.float32,
                      where: str = "arrays", mesh=None) -> Params:
    """Inverse of `params_to_numpy`; checks every shape against `cfg`. With `mesh`, each array goes from the host
    to its shards (`models.sharding.placer`)."""
    layer_fields = [f.name for f in dataclasses.fields(LayerParams)]
    place = _placer(cfg, mesh)
    np_dtype = jnp.dtype(dtype)

    def get(k):
        if k not in arrays:
            return None
        if place is None:
            return jnp.asarray(arrays[k], dtype)
        return place(k, np.asarray(arrays[k]).astype(np_dtype, copy=False))
    params = Params(embed=get("embed"), layers=LayerParams(**{f: get(f"layers.{f}") for f in layer_fields}),
                    final_norm=get("final_norm"), lm_head=get("lm_head"))
    check_shapes(cfg, params, where)
    return params
