"""The method framework: a registry of attention methods by name.

Every method and baseline is a `flax.struct.dataclass` implementing `models.attention.AttentionMethod`:
static configuration fields (`pytree_node=False`, hashable) and calibrated arrays as leaves, so a method
object is an ordinary argument of the jitted prefill/decode functions.
"""

from __future__ import annotations

from typing import Callable

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


def make_method(name: str, **kwargs):
    """Builds the method registered as `name` (keyword arguments go to its `build` classmethod)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention method {name!r}; expected one of {method_names()}")
    factory = _REGISTRY[name]
    build = getattr(factory, "build", factory)
    return build(**kwargs)


# Calibration entry points, by method name: `jsparse calibrate NAME` builds its options with `add_arguments`
# and calls `run(model, windows, args) -> Artifact`, where windows: i32[S, T] development token windows cut from
# the user's corpus (the CLI makes them; a calibrator that builds its own prompts may ignore them).
_CALIBRATORS: dict[str, tuple] = {}


def register_calibration(name: str, add_arguments, run, help: str = "") -> None:
    _CALIBRATORS[name] = (add_arguments, run, help)


def calibrators() -> dict[str, tuple]:
    return dict(_CALIBRATORS)
