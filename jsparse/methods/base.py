"""The method framework: a registry of attention methods by name.

Every method and baseline is a `flax.struct.dataclass` implementing `models.attention.AttentionMethod`:
static configuration fields (`pytree_node=False`, hashable) and calibrated arrays as leaves, so a method
object is an ordinary argument of the jitted prefill/decode functions.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable

import numpy as np

from jsparse.selection import is_real

_REGISTRY: dict[str, Callable] = {}


def register(name: str):
    """Class decorator: makes `make_method(name, ...)` build this method."""

    def deco(factory):
        _REGISTRY[name] = factory
        return factory

    return deco


def method_names() -> list[str]:
    return sorted(_REGISTRY)


def window_methods() -> list[str]:
    """The registered methods that honour a model's sliding window (`supports_window`); the model refuses the
    others when the window binds."""
    return sorted(n for n, f in _REGISTRY.items() if getattr(f, "supports_window", False))


def method_factory(name: str):
    """The class (or function) registered as `name`; raises ValueError naming the registered ones."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention method {name!r}; expected one of {method_names()}")
    return _REGISTRY[name]


# Options every builder takes: the model config, an artifact and its model fingerprint (`jsparse.build_method`
# fills cfg and fingerprint from the model), and `budget`, which the CLI and the eval harness give every method of a
# run (methods without a budget, such as dense or tsa, ignore it).
COMMON_OPTIONS = ("cfg", "artifact", "fingerprint", "budget")


def _fields(obj) -> set[str]:
    return {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else set()


def method_options(name: str, method: Any = None) -> list[str]:
    """The option names `make_method(name, ...)` accepts: COMMON_OPTIONS, the builder's named parameters, names
    it lists in `EXTRA_OPTIONS`, and the fields of the method it builds (and of its `inner` method), taken from
    `method` when given (a built instance), else from the registered class."""
    factory = _REGISTRY[name]
    build = getattr(factory, "build", factory)
    names = set(COMMON_OPTIONS) | set(getattr(factory, "EXTRA_OPTIONS", ()))
    names |= {p.name for p in inspect.signature(build).parameters.values()
              if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    target = method if method is not None else factory
    names |= _fields(target) | _fields(getattr(target, "inner", None))
    return sorted(names)


def takes_artifact(name: str) -> bool:
    """Whether method `name` reads a calibration artifact: its builder names an `artifact` parameter, or the factory
    (or its builder) says so with `TAKES_ARTIFACT` (wrappers that pass their options on)."""
    factory = method_factory(name)
    build = getattr(factory, "build", factory)
    flag = getattr(factory, "TAKES_ARTIFACT", getattr(build, "TAKES_ARTIFACT", None))
    return bool(flag) if flag is not None else "artifact" in inspect.signature(build).parameters


# Options counted in tokens (keys, rows, a page): one above the model's context can never be reached by a prompt, and
# the method would keep every key (min_tokens, sink, local, a page as wide as the cache) or the option would act as
# "all of them", either way without a word. Checked where the model's config is known (`jsparse.build_method`).
TOKEN_OPTIONS = ("min_tokens", "sink", "local", "page_size", "budget_tokens", "heat_window", "window",
                 "local_window", "local_sinks", "tsa_min_tokens")


def check_extents(name: str, kwargs: dict) -> None:
    """ValueError naming the option when a token-counted option (TOKEN_OPTIONS) is above the model's context or
    `dense_layers` above its layers (more dense layers than layers ran as all of them). Without a cfg: nothing."""
    cfg = kwargs.get("cfg")
    if cfg is None:
        return
    n = cfg.max_position_embeddings
    for key in TOKEN_OPTIONS:
        value = kwargs.get(key)
        if is_real(value) and value > n:
            raise ValueError(f"method {name!r} option {key}={value}: more than the model's context of {n} tokens; "
                             f"expected at most {n}")
    layers = kwargs.get("dense_layers")
    if is_real(layers) and layers > cfg.num_layers:
        raise ValueError(f"method {name!r} option dense_layers={layers}: expected 0..{cfg.num_layers} (the "
                         f"model's {cfg.num_layers} layers; {cfg.num_layers}: every layer dense)")


def make_method(name: str, **kwargs):
    """Builds the method registered as `name` (keyword arguments go to its `build` classmethod).

    Raises:
      ValueError: an unknown method name, or an option the method does not take (e.g. a misspelled `budgett`),
        naming the options it takes (`method_options`); with a cfg, a token-counted option above the model's
        context or dense_layers above its layers (`check_extents`).
    """
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention method {name!r}; expected one of {method_names()}")
    factory = _REGISTRY[name]
    build = getattr(factory, "build", factory)
    from models.config import ModelConfig
    if kwargs.get("cfg") is not None and not isinstance(kwargs["cfg"], ModelConfig):
        raise ValueError(f"method {name!r} cfg={kwargs['cfg']!r:.60}: expected a models.config.ModelConfig (a loaded "
                         "model's .cfg; jsparse.build_method(name, model) passes it)")
    budget = kwargs.get("budget")  # every method takes one (the CLI and eval give it to all); those without ignore it
    if budget is not None and (not is_real(budget) or not np.isfinite(budget) or budget <= 0):
        raise ValueError(f"method {name!r} budget={budget!r}: expected a fraction of the context in (0, 1] (sts: or "
                         "a whole number of keys above 1)")
    if isinstance(kwargs.get("artifact"), str) and not kwargs["artifact"].strip():
        raise ValueError(f"method {name!r} artifact={kwargs['artifact']!r}: expected an artifact folder's path, or "
                         "artifact=None for none")
    if kwargs.get("artifact") and not takes_artifact(name):
        raise ValueError(f"method {name!r} takes no artifact (artifact={kwargs['artifact']!r}); the methods that "
                         f"read one: {', '.join(n for n in method_names() if takes_artifact(n))}")
    if dataclasses.is_dataclass(factory):  # the options are known before building: check them first
        _check_options(name, kwargs, method_options(name))
    _check_bools(name, kwargs, factory)
    check_extents(name, kwargs)
    method = build(**kwargs)
    check_options(name, kwargs, method)  # wrappers: the options (and bool types) of what they built
    if kwargs.get("artifact"):  # the fingerprints its artifacts were calibrated for: checked where it runs
        from jsparse.artifacts import calibrated_for
        try:
            object.__setattr__(method, "_calibrated_for", calibrated_for(kwargs["artifact"]))
        except AttributeError:  # an object without a __dict__ (slots): nothing recorded
            pass
    return method


_BOOL_TYPES = {"bool": False, bool: False, "Optional[bool]": True, "bool | None": True}  # -> None allowed


def _bool_fields(obj) -> dict[str, bool]:
    """The dataclass fields of obj (and of its `inner` method) declared `bool` (-> False) or `Optional[bool]`
    (-> True: None allowed)."""
    out = {}
    for o in (obj, getattr(obj, "inner", None)):
        if dataclasses.is_dataclass(o):
            out.update({f.name: _BOOL_TYPES[f.type] for f in dataclasses.fields(o) if f.type in _BOOL_TYPES})
    return out


def _check_bools(name: str, kwargs: dict, target) -> None:
    """An option declared `bool` must be one: the string 'False' (what `--method-option m.x=False` gives, not
    being JSON) is truthy and would silently invert the user's choice."""
    fields = _bool_fields(target)
    for key in sorted(set(fields) & set(kwargs)):
        value = kwargs[key]
        if not (isinstance(value, (bool, np.bool_)) or (value is None and fields[key])):
            raise ValueError(f"method {name!r} option {key}={value!r}: expected true or false (a bool; on the "
                             "command line --method-option NAME.KEY=true)")


def check_options(name: str, kwargs: dict, method: Any = None) -> None:
    """Raises ValueError naming any of `kwargs` that method `name` does not take (`method_options`; pass the
    built `method` for wrappers, whose options include those of what they built)."""
    _check_options(name, kwargs, method_options(name, method))
    _check_bools(name, kwargs, method if method is not None else method_factory(name))


def _check_options(name: str, kwargs: dict, valid: list[str]) -> None:
    unknown = sorted(set(kwargs) - set(valid))
    if unknown:
        raise ValueError(f"method {name!r} takes no option {', '.join(map(repr, unknown))}; its options are "
                         f"{', '.join(v for v in valid if v not in ('cfg', 'fingerprint'))}")


# Calibration entry points, by method name: `jsparse calibrate NAME` builds its options with `add_arguments`
# and calls `run(model, windows, args) -> Artifact`, where windows: i32[S, T] development token windows cut from
# the user's corpus (the CLI makes them; a calibrator that builds its own prompts may ignore them).
_CALIBRATORS: dict[str, tuple] = {}
_CALIBRATION_CHECKS: dict[str, object] = {}


def register_calibration(name: str, add_arguments, run, help: str = "", check=None) -> None:
    """`jsparse calibrate NAME`: add_arguments(parser), run(model, windows, args, progress) -> Artifact, and
    optionally check(args), which refuses bad arguments before the model loads (named by their flags)."""
    _CALIBRATORS[name] = (add_arguments, run, help)
    _CALIBRATION_CHECKS[name] = check


def calibration_check(name: str):
    """The argument check registered with calibrator `name` (None: none)."""
    return _CALIBRATION_CHECKS.get(name)


def calibrators() -> dict[str, tuple]:
    return dict(_CALIBRATORS)
