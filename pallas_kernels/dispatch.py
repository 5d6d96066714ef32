"""The implementation choice of a kernel package with a Pallas GPU kernel and a jnp reference."""

from __future__ import annotations

from typing import Callable

import jax

GPU_OR_REFERENCE = ("pallas_gpu", "reference")


def gpu_or_reference(implementation: str | None, unsupported: Callable[[], str | None]) -> str:
    """"pallas_gpu" or "reference": None picks "pallas_gpu" on a GPU when the kernel takes the call (`unsupported()`
    returns None, else why not), "reference" elsewhere; a named implementation never falls back (ValueError naming
    the value, or why the kernel cannot run the call)."""
    if implementation is None:
        return "pallas_gpu" if jax.default_backend() == "gpu" and unsupported() is None else "reference"
    if implementation not in GPU_OR_REFERENCE:
        raise ValueError(f"implementation={implementation!r}: expected one of {GPU_OR_REFERENCE} or None")
    if implementation == "pallas_gpu":
        reason = unsupported()
        if reason is not None:
            raise ValueError(f"implementation='pallas_gpu' cannot run this call: {reason}")
    return implementation
