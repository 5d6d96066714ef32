"""Every memory access of a Pallas Triton kernel kept inside its block, checked in interpret mode on the CPU.

On the GPU a lane of a load or store that its mask lets through (or any lane of an unmasked `ref[...]` read or
write) outside the ref's block reads or overwrites another program's rows, or memory past the array; the Pallas
interpreter drops such stores and pads such loads, so a missing mask passes every CPU test. Inside
`checked_memory`, `plgpu.load`, `plgpu.store` and `ref[...]` reads and writes compute which of their lanes fall
outside the ref (`in_bounds`); an access with a stray lane that its mask lets through is recorded (kernel source
line, block shape, access shape, stray lanes) and its values are poisoned (NaN, or the integer minimum), so the
kernel's result no longer equals its reference either. Leaving the context fails the test if anything was recorded.

    def test_kernel_stays_in_its_blocks():
        with checked_memory():
            out = kernel.__wrapped__(..., interpret=True)  # unjitted: a cached trace would skip the checks
        assert_close(out, reference(...))

The ref is the kernel's block (the BlockSpec's shape), as the kernel sees it; a block that overhangs the array's
edge is padded by the interpreter, and its lanes past the edge are not seen here.
"""

from __future__ import annotations

import contextlib
import os
import sys

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax._src.state import indexing, primitives as state_primitives
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_HERE = os.path.abspath(__file__)
_JAX = os.path.dirname(os.path.abspath(jax.__file__))


def _traced(x) -> bool:
    return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(x))


def _lanes(indexer: indexing.NDIndexer, xp):
    """(coordinates, ok) of the lanes of one indexer: per dimension of the indexed ref the coordinate of each lane,
    broadcastable to the access's shape (`get_indexer_shape`, numpy's placement of the integer-array indices), and
    bool[access shape] whether every coordinate of the lane lies inside the ref."""
    shape = tuple(indexer.get_indexer_shape())
    is_int = [not isinstance(s, pl.Slice) for s in indexer.indices]
    ints = np.flatnonzero(is_int)
    int_rank = len(indexer.int_indexer_shape)
    # The integer-array indices' axes start where the first of them is when they are adjacent, else at 0.
    first = int(ints[0]) if len(ints) and np.all(np.diff(ints) == 1) else 0
    coords, ok, j = [], xp.ones(shape, bool), 0
    for s, n in zip(indexer.indices, indexer.shape):
        if isinstance(s, pl.Slice):
            axis = j if j < first else j + int_rank
            c = (s.start + s.stride * xp.arange(s.size)).reshape([-1 if a == axis else 1 for a in range(len(shape))])
            j += 1
        else:
            c = xp.asarray(s)
            c = c.reshape((1,) * first + c.shape + (1,) * (len(shape) - first - c.ndim)) if c.ndim else c
        coords.append(c)
        ok = ok & (c >= 0) & (c < n)
    return coords, ok


def in_bounds(transforms, xp=jnp):
    """bool[access shape]: which lanes of an access through `transforms` (a ref's `.at[...]` indexers, outermost
    first; () for the whole ref) fall inside the ref; a lane outside an intermediate view counts as outside.

    Index forms: `pl.ds` / `pl.Slice` (static or traced start, any stride), integer arrays (broadcast together, placed
    as numpy places them), scalars; several indexers are composed. xp: jnp, or np when no index is traced."""
    coords, ok = None, xp.ones((), bool)
    for t in transforms:
        if not isinstance(t, indexing.NDIndexer):
            raise NotImplementedError(f"checked_memory: a ref transform {type(t).__name__} (only indexers)")
        lanes, lane_ok = _lanes(t, xp)
        if coords is None:
            coords, ok = lanes, lane_ok
            continue
        # The view's lane i is the previous view's lane lanes(i): take its coordinates there.
        prev_shape = tuple(t.shape)
        at = tuple(xp.clip(c, 0, n - 1) for c, n in zip(lanes, prev_shape))
        coords = [xp.broadcast_to(c, prev_shape)[at] for c in coords]
        ok = xp.broadcast_to(ok, prev_shape)[at] & lane_ok
    return ok


def _kernel_line() -> str:
    """Where the access is: the first caller outside jax, this module and the standard library, and its callers
    up to the next frame that is not (`gpu.py:98 <- gpu.py:157`: a helper and the kernel line that called it)."""
    frame, lines = sys._getframe(2), []
    while frame is not None and len(lines) < 3:
        path = os.path.abspath(frame.f_code.co_filename)
        ours = path != _HERE and not path.startswith(_JAX) and "site-packages" not in path and "/lib/python" not in path
        if ours:
            lines.append(f"{os.path.relpath(path) if not lines else os.path.basename(path)}:{frame.f_lineno}")
        elif lines:
            break
        frame = frame.f_back
    return " <- ".join(lines) or "?"


def _poison(x, stray):
    """x with every value replaced where `stray` (a bool scalar): NaN, the integer minimum, or the negation."""
    if stray is False:
        return x
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.inexact):
        bad = jnp.asarray(jnp.nan, x.dtype)
    elif jnp.issubdtype(x.dtype, jnp.integer):
        bad = jnp.asarray(jnp.iinfo(x.dtype).min, x.dtype)
    else:
        bad = jnp.logical_not(x)
    return jnp.where(stray, bad, x)


class _Recorder:
    """The accesses found with a stray lane: 'op at file:line' -> (block shape, access shape, most stray lanes)."""

    def __init__(self):
        self.found: dict[str, tuple] = {}

    def check(self, op: str, ref, idx, mask):
        """The stray flag (a bool scalar, maybe traced) of an access of `ref` at `idx` (None: ref's own indexers)
        under `mask`; recorded, at trace time when it is static, else by a host callback when the kernel runs."""
        base, transforms = state_primitives.get_ref_and_transforms(ref, idx, op)
        if not transforms:
            return False
        where = f"{op} at {_kernel_line()}"
        shapes = (tuple(base.shape), tuple(transforms[-1].get_indexer_shape()))
        if not _traced(transforms):
            outside = ~in_bounds(transforms, np)
            if not outside.any():
                return False
            if mask is None or not _traced(mask):
                n = int(np.sum(outside & (True if mask is None else np.asarray(mask))))
                self._record(where, shapes, n)
                return n > 0
        stray = ~in_bounds(transforms) & (True if mask is None else mask)
        n = jnp.sum(stray.astype(jnp.int32))
        jax.debug.callback(lambda n: self._record(where, shapes, int(n)), n)
        return n > 0

    def _record(self, where, shapes, n):
        if n > 0:
            most = self.found.get(where, (None, None, 0))[2]
            self.found[where] = (*shapes, max(most, n))

    def report(self) -> str:
        return "\n".join(f"  {where}: block {block}, access {access}, {n} lanes outside the block"
                         for where, (block, access, n) in sorted(self.found.items()))


@contextlib.contextmanager
def checked_memory():
    """Within: every `plgpu.load` / `plgpu.store` and every `ref[...]` read or write traced is checked (module
    docstring). Yields the recorder (`.found`: the stray accesses so far). On exit, fails if any access let a lane
    outside its block through (the list is also added to an exception raised inside). Run the kernels unjitted,
    so that they are traced here, and with `interpret=True`."""
    rec = _Recorder()
    load, store = plgpu.load, plgpu.store
    ref_get, ref_swap = state_primitives.ref_get, state_primitives.ref_swap

    def checked_load(ref, *, mask=None, **kw):
        return _poison(load(ref, mask=mask, **kw), rec.check("plgpu.load", ref, None, mask))

    def checked_store(ref, val, *, mask=None, **kw):
        store(ref, _poison(val, rec.check("plgpu.store", ref, None, mask)), mask=mask, **kw)

    def checked_get(ref, idx=None):
        return _poison(ref_get(ref, idx), rec.check("ref[...] read", ref, idx, None))

    def checked_swap(ref, idx, value, _function_name="ref_swap"):
        value = _poison(value, rec.check("ref[...] write", ref, idx, None))
        return ref_swap(ref, idx, value, _function_name=_function_name)

    # Traces cached before (jitted functions the kernels' wrappers call) would run unchecked kernels, and traces made
    # here would run checked kernels after: none outlives the context.
    jax.clear_caches()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plgpu, "load", checked_load)
        mp.setattr(plgpu, "store", checked_store)
        # `ref[...]` and `ref[...] = x` look these up in the module at each call (jax/_src/state/types.py).
        mp.setattr(state_primitives, "ref_get", checked_get)
        mp.setattr(state_primitives, "ref_swap", checked_swap)
        try:
            yield rec
            jax.effects_barrier()
        except BaseException as e:
            jax.effects_barrier()
            if rec.found:
                e.add_note("accesses outside their blocks:\n" + rec.report())
            raise
        finally:
            jax.clear_caches()
    assert not rec.found, "accesses outside their blocks:\n" + rec.report()
