"""Kernels per shard: run an attention op under `jax.shard_map` when a mesh is set.

XLA's SPMD partitioner cannot split a Pallas call (a custom call): given sharded operands it would gather them
onto every device and run the whole op on each. Every attention op here is independent per batch row and per
KV head (a GQA group's query heads live with their KV head), so under a mesh with axes `data` (batch rows) and
`model` (heads) the entry points run their kernel per shard: each device attends over its own rows and KV
heads, with no collective. The mesh is the ambient one (`jax.set_mesh`, which `models.sharding.use_mesh` sets);
with no mesh, or a mesh of one device, the op is called as is.

The axis names are the project's convention (`models.sharding.MESH_AXES`; this package imports nothing from the
rest): the batch dim of every operand splits over `data`, the head dim over `model`. Heads split in contiguous
blocks, so query heads [i*Hq/m, (i+1)*Hq/m) and KV heads [i*Hkv/m, (i+1)*Hkv/m) land on device i together.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Callable, Sequence

import jax
from jax.sharding import PartitionSpec as P

DATA, MODEL = "data", "model"

# Set while `per_shard` runs an op unsplit (a split dim that does not divide its mesh axis): the op's own entry
# point, called again from there, must not try to split it again (that recursed without end).
_UNSPLIT = contextvars.ContextVar("jsparse_unsplit", default=False)


def active_mesh():
    """The ambient mesh when it has more than one device, else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.manual_axes or math.prod(dict(mesh.shape).values()) == 1 or _UNSPLIT.get():
        return None  # no mesh, inside a shard_map already (manual axes), a mesh of one, or `per_shard`'s fallback
    return mesh


@contextlib.contextmanager
def _unsplit():
    token = _UNSPLIT.set(True)
    try:
        yield
    finally:
        _UNSPLIT.reset(token)


def dims(ndim: int, batch: int | None = None, heads: int | None = None) -> tuple:
    """A spec template: ndim entries, `data` at dim `batch`, `model` at dim `heads` (None: not split)."""
    out = [None] * ndim
    if batch is not None:
        out[batch] = DATA
    if heads is not None:
        out[heads] = MODEL
    return tuple(out)


def _spec(mesh, template: tuple, shape) -> P | None:
    """The PartitionSpec of `template` on `mesh` for an operand of `shape`; None when a split dim does not divide
    its axis (the caller then runs unsplit)."""
    sizes = dict(mesh.shape)
    out = []
    for name, n in zip(template, shape):
        if name is None or name not in sizes:
            out.append(None)
        elif n % sizes[name]:
            return None
        else:
            out.append(name)
    return P(*out)


def per_shard(fn: Callable, args: Sequence[jax.Array], templates: Sequence[tuple], out_templates):
    """fn(*args), per shard under the ambient mesh.

    Args:
      fn: the op on local shards (it sees B / data rows and H / model heads).
      args: its operands: arrays, or Python scalars (a known `layer`), taken as 0-d arrays.
      templates: one `dims(...)` tuple per operand (() for a replicated scalar).
      out_templates: a `dims(...)` tuple, or a tuple of them for several outputs.

    Returns:
      fn's output(s), as one global array each. With no mesh, or a mesh of one device, or an operand whose split
      dim does not divide the mesh axis (left to XLA's partitioner then), `fn(*args)`.
    """
    mesh = active_mesh()
    if mesh is None:
        return fn(*args)
    args = [a if hasattr(a, "shape") else jax.numpy.asarray(a) for a in args]
    in_specs = tuple(_spec(mesh, t, a.shape) for t, a in zip(templates, args))
    if any(s is None for s in in_specs):
        with _unsplit():  # fn's entry point sees no mesh, so it runs the op whole instead of coming back here
            return fn(*args)
    multi = isinstance(out_templates[0], tuple) if out_templates else False

    def out_spec(t):
        return P(*(n if n is None or n in dict(mesh.shape) else None for n in t))

    out_specs = tuple(out_spec(t) for t in out_templates) if multi else out_spec(out_templates)
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)
