"""Training TokenButler's predictor against a frozen model's attention logits.

One step, data-parallel over the devices present (a 1-D mesh with axis 'data'; `shard_map` gives every device its
slice of the batch, gradients are averaged with `pmean`, the predictor's parameters and optimizer state are
replicated; the frozen model's params are FSDP-sharded over 'data' at rest and all-gathered for each step):

  1. the frozen model runs over the batch with `QKRecorder` as its attention method: dense causal attention that
     records every layer's queries and keys (after RoPE) and layer 0's normed input h0;
  2. the predictor maps h0 to q', k' for layers 1..L-1;
  3. loss = mean over layers >= 1, heads and batch of `logit_mse(q, k, q', k')`, TokenButler's blockwise MSE between
     the model's and the predictor's pre-softmax logits (causal pairs by default; see pallas_kernels/logit_mse);
  4. optax: clip the global gradient norm, AdamW with linear warmup and cosine decay (to `end_lr_ratio` of the
     peak).

Sequence length. The loss kernel zero-pads the sequence to a multiple of its blocks, which adds exactly zero to the
loss and gradients (pallas_kernels/logit_mse/gpu.py), so any `seq_len` >= 16 works; every chunk is full length, so
no token of a batch is padding.

Checkpoints (orbax, `OUT/checkpoints/<step>`): predictor params and optimizer state (which holds the step count that
drives the schedule) plus JSON metadata: step, data position, seed, the model's fingerprint, the predictor config,
the data's fingerprint and the training config. A run whose OUT already holds checkpoints resumes from the latest
one: the data stream is a pure function of (seed, step) (train/data.py), so the resumed run reads exactly the
batches the uninterrupted run would have, and no step is lost or repeated. Ctrl-C (KeyboardInterrupt) and SIGTERM
(what `timeout`, schedulers and preemption send; raised as `Terminated`, a KeyboardInterrupt) save a checkpoint of the
last completed step before exiting (none when the periodic save the interrupt arrived during or after holds it), and
then propagate as themselves; a SIGTERM after the last step waits for the final checkpoint and the artifact, then
propagates; a killed process (SIGKILL) resumes from its last periodic checkpoint. A step's loss line
is written before the step counts as completed, so an interrupt between the two re-runs that step rather than losing
its line. Resuming with another model, predictor shape, data or training config is an error naming both values.

When training finishes, OUT holds a "butler" artifact (artifact.json + arrays.npz: the flattened params, the
predictor config, the model fingerprint) that `--method butler --artifact OUT` loads, and loss.jsonl (one line per
step: step, loss, learning rate, gradient norm, tokens/s). Running a finished run again trains nothing and keeps the
artifact already there when it is that run's export (same fingerprint, step count and arrays), so metadata added to it
since (`dense_set` and `dense_set_calibration`, from `bench butler_coverage --dense-count`) stays; any other artifact
there (none, a damaged one, an earlier export) is replaced by a fresh export, without those keys. An OUT holding
another method's artifact is refused before any work (`check_target`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import gc
import hashlib
import json
import logging
import math
import os
import signal
import sys
import threading
import time
import warnings
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec as P

from jsparse.artifacts import (FINGERPRINT_SCHEME, Artifact, ArtifactError, check_artifact_target, load_artifact,
                               save_artifact, write_replace)
from jsparse.methods.butler import ARTIFACT_KIND
from jsparse.methods.butler_predictor import Predictor, PredictorConfig, flatten_params, init_params
from models import llama
from models.cache import init_cache
from models.config import ModelConfig
from pallas_kernels.dense import dense_prefill
from pallas_kernels.logit_mse import logit_mse
from train.data import ChunkStream

Array = jax.Array
CHECKPOINTS = "checkpoints"
LOSS_LOG = "loss.jsonl"
MIN_SEQ_LEN = 16
SEED_MAX = 2**32 - 1  # the largest seed: jax PRNG keys keep 32 bits


class TrainError(ValueError):
    """A training run that cannot start or resume (names the bad value and what was expected)."""


# ----------------------------------------------------------------------------------------------- the frozen model


@struct.dataclass
class QKState:
    q: Array  # [L', B, Hq, T, D] queries of layers 1..L-1 (after RoPE), in the model's dtype
    k: Array  # [L', B, Hkv, T, D]
    h0: Array  # [B, T, E] layer 0's normed attention input


@struct.dataclass
class QKRecorder:
    """An attention method that runs dense causal attention and records q, k of every layer >= 1 and layer 0's
    normed input (training only; prefill only)."""

    def init_state(self, cfg, batch, max_len, dtype=jnp.float32):
        L = cfg.num_layers - 1
        return QKState(q=jnp.zeros((L, batch, cfg.num_heads, max_len, cfg.head_dim), dtype),
                       k=jnp.zeros((L, batch, cfg.num_kv_heads, max_len, cfg.head_dim), dtype),
                       h0=jnp.zeros((batch, max_len, cfg.hidden_size), dtype))

    def layer_info(self, cfg):
        return None

    def prefill(self, ctx, q, k, v, state):
        slot = jnp.maximum(ctx.layer - 1, 0)  # layer 0 writes slot 0, which layer 1 then overwrites
        qs = jax.lax.dynamic_update_index_in_dim(state.q, jnp.swapaxes(q, 1, 2).astype(state.q.dtype), slot, 0)
        ks = jax.lax.dynamic_update_index_in_dim(state.k, jnp.swapaxes(k, 1, 2).astype(state.k.dtype), slot, 0)
        h0 = jnp.where(ctx.layer == 0, ctx.hidden.astype(state.h0.dtype), state.h0)
        return dense_prefill(q, k, v), QKState(q=qs, k=ks, h0=h0)

    def decode(self, ctx, q, cache, state):
        raise NotImplementedError("QKRecorder records prefill only")


def record_qk(params, cfg: ModelConfig, tokens: Array):
    """The frozen model's targets for a batch of full-length chunks.

    Args:
      tokens: i32[B, T].
    Returns:
      (h0: [B, T, E], q: [B, L' * Hq, T, D], k: [B, L' * Hkv, T, D]), layers stacked layer-major into the head
      axis as `logit_mse` expects (q head l * Hq + h uses k head l * Hkv + h // G); all gradient-free.
    """
    B, T = tokens.shape
    dtype = params.embed.dtype
    rec = QKRecorder()
    cache = init_cache(cfg, B, T, dtype)
    _, _, st = llama.prefill(params, cfg, rec, tokens, jnp.full((B,), T, jnp.int32), cache,
                             rec.init_state(cfg, B, T, dtype))
    Lp = cfg.num_layers - 1
    q = jnp.swapaxes(st.q, 0, 1).reshape(B, Lp * cfg.num_heads, T, cfg.head_dim)
    k = jnp.swapaxes(st.k, 0, 1).reshape(B, Lp * cfg.num_kv_heads, T, cfg.head_dim)
    return jax.lax.stop_gradient(st.h0), jax.lax.stop_gradient(q), jax.lax.stop_gradient(k)


def predictor_qk(pparams, pcfg: PredictorConfig, h0: Array):
    """h0: [B, T, E] -> (q': f32[B, L' * Hq, T, d'], k': f32[B, L' * Hk', T, d']) in `logit_mse`'s layout."""
    B, T = h0.shape[:2]
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    qp, kp = Predictor(pcfg).apply({"params": pparams}, h0, positions)  # [B, T, L', H, d']
    qp = qp.transpose(0, 2, 3, 1, 4).reshape(B, -1, T, pcfg.head_dim)
    kp = kp.transpose(0, 2, 3, 1, 4).reshape(B, -1, T, pcfg.head_dim)
    return qp, kp


# ----------------------------------------------------------------------------------------------- configuration


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of a run (all part of the checkpoint's identity, `identity`, except checkpoint_every,
    keep_checkpoints, loss_impl and interpret, which a resumed run may change).

    Attributes:
      seq_len: tokens per chunk (>= 16, <= the model's context). steps: optimizer steps of the whole run.
      batch_size: chunks per step over all devices (a multiple of the device count).
      learning_rate: AdamW peak; warmup_steps of linear warmup from 0, then cosine decay to
        end_lr_ratio * learning_rate at count `steps`, one past the last update (`make_schedule`); the last update's
        rate is a little above it (by about (peak - end) * 2.5 / (steps - warmup_steps)**2: 2.3x the end value for 6
        steps with 2 of warmup, negligible for thousands). weight_decay: AdamW's decoupled decay.
      clip_norm: global gradient-norm clip. checkpoint_every: steps between checkpoints (the last step is always
        saved). keep_checkpoints: how many to keep. seed: predictor init and data shuffle.
      causal: the loss averages over causal pairs only (see logit_mse). loss_impl: logit_mse implementation
        ("gpu", "tpu", "xla", or None for the backend's). interpret: run the loss kernel in the interpreter (tests).
    """

    seq_len: int
    steps: int
    batch_size: int = 8
    learning_rate: float = 1e-3
    warmup_steps: int = 100
    end_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    seed: int = 0
    causal: bool = True
    loss_impl: Optional[str] = None
    interpret: bool = False

    def validate(self, cfg: ModelConfig | None, num_devices: int) -> "TrainConfig":
        """Raises TrainError naming the first bad field and its range; returns self. With cfg None, checks what needs
        no model (everything but seq_len's upper bounds, the model's context and sliding window): the command runs
        that before it loads the model, and the whole check after."""
        def pos_int(name, minimum=1):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
                raise TrainError(f"{name}={v!r}: expected an integer >= {minimum}")

        for name in ("steps", "batch_size", "checkpoint_every", "keep_checkpoints"):
            pos_int(name)
        pos_int("warmup_steps", 0)
        pos_int("seed", 0)
        if self.seed > SEED_MAX:  # jax keys keep 32 bits; numpy's shuffle would take more, and overflow at 2**63
            raise TrainError(f"seed={self.seed}: expected an integer in [0, {SEED_MAX}]")
        W = None if cfg is None else cfg.window_size
        if W is not None and isinstance(self.seq_len, int) and self.seq_len > W:
            raise TrainError(f"seq_len={self.seq_len}: the model's sliding-window layers attend within {W} tokens, "
                             f"which the predictor's targets (full causal attention logits) do not model; expected "
                             f"seq_len <= {W}")
        context = math.inf if cfg is None else cfg.max_position_embeddings
        if (not isinstance(self.seq_len, int) or isinstance(self.seq_len, bool)
                or not MIN_SEQ_LEN <= self.seq_len <= context):
            raise TrainError(f"seq_len={self.seq_len!r}: expected an integer "
                             + (f">= {MIN_SEQ_LEN} (at most the model's context)" if cfg is None else
                                f"in [{MIN_SEQ_LEN}, {context}] (the model's context)"))
        if self.warmup_steps >= self.steps:
            raise TrainError(f"warmup_steps={self.warmup_steps}: expected fewer than steps={self.steps}")
        if self.batch_size % num_devices:
            raise TrainError(f"batch_size={self.batch_size} is not a multiple of the {num_devices} devices the "
                             "batch is split over")
        for name, open_low in (("learning_rate", True), ("end_lr_ratio", False), ("weight_decay", False)):
            v = getattr(self, name)  # in (0, 1] or [0, 1]; nan fails both comparisons
            if (not isinstance(v, (int, float)) or isinstance(v, bool)
                    or not ((0.0 < v) if open_low else (0.0 <= v)) or not v <= 1.0):
                raise TrainError(f"{name}={v!r}: expected a number in {'(0' if open_low else '[0'}, 1.0]")
        if (not isinstance(self.clip_norm, (int, float)) or isinstance(self.clip_norm, bool)
                or not 0 < self.clip_norm < math.inf):
            raise TrainError(f"clip_norm={self.clip_norm!r}: expected a positive finite number")
        if self.loss_impl not in (None, "gpu", "tpu", "xla"):
            raise TrainError(f"loss_impl={self.loss_impl!r}: expected 'gpu', 'tpu', 'xla' or None")
        return self

    def identity(self) -> dict:
        """The fields a resumed run must share with the checkpoint."""
        d = dataclasses.asdict(self)
        for k in ("keep_checkpoints", "checkpoint_every", "loss_impl", "interpret"):
            d.pop(k)
        return d


def make_schedule(tc: TrainConfig):
    """The learning rate by optimizer count: update i (0-based; step i + 1 of the log) uses schedule(i). The cosine
    reaches end_lr_ratio * learning_rate at count `steps`, one past the last update, which so uses a rate a little
    above the end value (kept as the shipped predictor was trained: a checkpoint resumed under another schedule would
    finish differently from its uninterrupted run)."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=tc.learning_rate, warmup_steps=tc.warmup_steps, decay_steps=tc.steps,
        end_value=tc.learning_rate * tc.end_lr_ratio)


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(tc.clip_norm),
                       optax.adamw(make_schedule(tc), weight_decay=tc.weight_decay))


def data_mesh(devices=None) -> jax.sharding.Mesh:
    """A 1-D mesh over `devices` (default: all) with axis 'data'."""
    devices = list(devices or jax.devices())
    return jax.sharding.Mesh(np.asarray(devices), ("data",))


def fsdp_dims(model_params, n: int):
    """Per frozen-model param, the dim split over the n devices of 'data' (FSDP at rest): the last dim whose size
    n divides, or -1 (replicated: a vector too small, or n == 1). Same tree as the params (hashable: a static
    argument of `make_train_step`)."""
    def dim(x):
        fits = [i for i, size in enumerate(x.shape) if n > 1 and size % n == 0 and size >= n]
        return fits[-1] if fits else -1
    return jax.tree_util.tree_map(dim, model_params)


def fsdp_spec(d: int) -> P:
    return P() if d < 0 else P(*([None] * d + ["data"]))


@functools.lru_cache(maxsize=8)
def make_train_step(mesh, cfg: ModelConfig, pcfg: PredictorConfig, tc: TrainConfig, mdims=None):
    """jit(shard_map(step)): (pparams, opt_state, model_params, tokens i32[B, T]) -> (pparams, opt_state, loss,
    grad_norm); tokens sharded over 'data', the predictor and its optimizer state replicated. The frozen model's
    params are replicated (mdims None) or FSDP-sharded at rest: mdims (`fsdp_dims`, the params' tree) names the
    dim of each param split over 'data' (-1: replicated), and the step all-gathers them before the forward (each
    device holds 1/n of the frozen model between steps; the gathered copy lives for the step only). Cached, so that
    runs of one process with the same settings (a resume, tests) reuse the compiled step."""
    tx = make_optimizer(tc)

    def loss_fn(pparams, h0, q, k):
        qp, kp = predictor_qk(pparams, pcfg, h0)
        # The kernel's matmuls run in the model's dtype (bf16 on accelerators); params and updates stay f32.
        qp, kp = qp.astype(q.dtype), kp.astype(q.dtype)
        per_head = logit_mse(q, k, qp, kp, causal=tc.causal, implementation=tc.loss_impl,
                             interpret=tc.interpret)  # f32[b, L' * Hq]
        return jnp.mean(per_head)

    def gather(mparams):
        if mdims is None:
            return mparams
        return jax.tree_util.tree_map(
            lambda x, d: x if d < 0 else jax.lax.all_gather(x, "data", axis=d, tiled=True), mparams, mdims)

    def local_step(pparams, opt_state, mparams, tokens):
        h0, q, k = record_qk(gather(mparams), cfg, tokens)
        loss, grads = jax.value_and_grad(loss_fn)(pparams, h0, q, k)
        grads = jax.lax.pmean(grads, "data")
        loss = jax.lax.pmean(loss, "data")
        updates, opt_state = tx.update(grads, opt_state, pparams)
        return optax.apply_updates(pparams, updates), opt_state, loss, optax.tree.norm(grads)

    mspec = P() if mdims is None else jax.tree_util.tree_map(fsdp_spec, mdims)
    step = jax.shard_map(local_step, mesh=mesh, in_specs=(P(), P(), mspec, P("data")),
                         out_specs=(P(), P(), P(), P()), check_vma=False)
    return jax.jit(step)


# ----------------------------------------------------------------------------------------------- checkpoints


def _manager(out_dir: str, tc: TrainConfig):
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.path.join(out_dir, CHECKPOINTS))
    options = ocp.CheckpointManagerOptions(max_to_keep=tc.keep_checkpoints, create=True)
    return ocp.CheckpointManager(path, options=options)


def state_digest(tree) -> str:
    """A checksum of a checkpoint's arrays (dtype, shape and bytes of each leaf, in tree order). `_save` writes it into
    the checkpoint's metadata and `_resume` compares it after the restore: a damaged data file can read back as other
    numbers without an error."""
    h = hashlib.blake2b(digest_size=16)
    for x in jax.tree_util.tree_leaves(tree):
        a = np.ascontiguousarray(jax.device_get(x))
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


class CheckpointDigestError(ValueError):
    """A restored checkpoint whose arrays differ from the digest written with them (damage, moved aside)."""


def _save(mngr, step: int, pparams, opt_state, meta: dict) -> None:
    import orbax.checkpoint as ocp

    state = {"params": pparams, "opt_state": opt_state}
    mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                            meta=ocp.args.JsonSave({**meta, "state_digest": state_digest(state)})),
              force=True)


def _check_resume(meta: dict, expected: dict, where: str) -> None:
    """Raises TrainError naming the first field where a checkpoint differs from this run."""
    # The training config before the data: a changed seq_len changes the data's chunks too, and is what to name.
    what = {"model_fingerprint": "model", "model_dtype": "model dtype", "predictor_config": "predictor config",
            "train_config": "training config", "data_fingerprint": "data"}
    for key, label in what.items():
        if key == "model_dtype" and key not in meta:
            continue  # a checkpoint written before the dtype was recorded
        if meta.get(key) != expected[key]:
            if key == "model_fingerprint" and meta.get("fingerprint_scheme", 1) != FINGERPRINT_SCHEME:
                raise TrainError(
                    f"the checkpoint in {where} was written by an earlier jsparse, whose model fingerprint (scheme "
                    f"{meta.get('fingerprint_scheme', 1)}) cannot be compared with this one's (scheme "
                    f"{FINGERPRINT_SCHEME}), so it cannot be told to be of this model: training cannot resume from it; "
                    "use another --out, or delete its checkpoints to start over")
            if key == "model_fingerprint":
                raise TrainError(
                    f"the checkpoint in {where} was made for another model: fingerprint {meta.get(key)!r} "
                    f"({meta.get('model_name', '?')}), but the loaded model's is {expected[key]!r}; use another --out")
            if key in ("train_config", "predictor_config"):
                old = meta.get(key)
                if not isinstance(old, dict):
                    raise TrainError(f"the checkpoint in {where} records {key}={old!r}, not a {label} (its metadata is "
                                     "damaged): delete its checkpoints to start over, or use another --out")
                raise TrainError(_config_differs(where, label, old, expected[key]))
            if key == "data_fingerprint":  # (the chunk counts when they differ: a digest alone says little)
                old_n, now_n = meta.get("num_chunks"), expected.get("num_chunks")
                counts = old_n is not None and now_n is not None and old_n != now_n
                raise TrainError(f"the checkpoint in {where} was made with another data set: fingerprint "
                                 f"{meta.get(key)!r}{f' ({old_n} chunks)' if counts else ''}, now {expected[key]!r}"
                                 f"{f' ({now_n} chunks)' if counts else ''}; use the same --data files, unchanged, "
                                 "to resume, or another --out")
            raise TrainError(f"the checkpoint in {where} was made with another {label}: {meta.get(key)!r}, now "
                             f"{expected[key]!r}; use the same {label} to resume, or another --out")


def _config_differs(where: str, label: str, old: dict, now: dict) -> str:
    """The error of a checkpoint whose `label` config (`old`) differs from this run's (`now`): the differing fields."""
    diff = {k: (old.get(k), now.get(k)) for k in sorted(set(old) | set(now)) if old.get(k) != now.get(k)}
    return (f"the checkpoint in {where} used another {label}: (checkpoint, now) = {diff}; use the same settings to "
            "resume, or another --out")


def check_resume_config(out_dir: str, tc: TrainConfig) -> None:
    """Refuses, before the model loads, an out_dir whose latest checkpoint was made with another training config
    (TrainError naming the fields that differ, as the resume itself would). A checkpoint that does not read back,
    or records no training config, is left to the resume (`_find_checkpoint`), as is everything that needs the
    model (its fingerprint, the predictor config, the data)."""
    try:
        meta = read_checkpoint_meta(out_dir)
    except Exception:  # noqa: BLE001  (a damaged checkpoint: the resume moves it aside and tries the one before)
        return
    old = None if meta is None else meta.get("train_config")
    if isinstance(old, dict) and old != tc.identity():
        raise TrainError(_config_differs(os.path.join(out_dir, CHECKPOINTS), "training config", old, tc.identity()))


def _restore(mngr, step: int, pparams, opt_state, digest: str | None = None):
    """(params, opt_state) of checkpoint `step`; with `digest` (its metadata's `state_digest`; None for a checkpoint
    written before it was recorded) a CheckpointDigestError when the arrays read back differ from it."""
    import orbax.checkpoint as ocp

    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                            {"params": pparams, "opt_state": opt_state})
    state = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]
    if digest is not None and state_digest(state) != digest:
        raise CheckpointDigestError(f"its arrays read back differ from the digest written with them ({digest})")
    return state["params"], state["opt_state"]


def _read_meta(mngr, step: int) -> dict:
    import orbax.checkpoint as ocp

    return dict(mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"])


# Failures of a restore that say nothing about the checkpoint (out of host or device memory, a device error): they
# propagate and no checkpoint is moved aside.
NOT_DAMAGE = (MemoryError, jax.errors.JaxRuntimeError)
# OSErrors of the machine's, not of the checkpoint's bytes (file-descriptor limits, permissions, a network
# filesystem's timeout, no memory, an interrupted or would-block call): they propagate too. EIO and the rest (a
# missing file, a bad block) count as damage.
NOT_DAMAGE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.EACCES, errno.EPERM, errno.ETIMEDOUT, errno.ENOMEM,
                               errno.EAGAIN, errno.EINTR})


def _chain(e: BaseException | None):
    """e, then its cause (or else its context), and theirs in turn, each once."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _codes(tb):
    """The code objects of a traceback's frames, outermost first."""
    while tb is not None:
        yield tb.tb_frame.f_code
        tb = tb.tb_next


def _not_damage(e: BaseException) -> bool:
    """Whether a failed restore says nothing about the checkpoint: NOT_DAMAGE, or an OSError of NOT_DAMAGE_ERRNOS,
    raised as is or as the cause or context of what orbax raised."""
    return any(isinstance(x, NOT_DAMAGE) or (isinstance(x, OSError) and x.errno in NOT_DAMAGE_ERRNOS)
               for x in _chain(e))


# Checkpoint folders whose failed reads leave nothing printed (`_quiet_failed_reads`), and the coroutines of orbax's
# array reads, which a failed read leaves unawaited.
_QUIET_FOLDERS: set[str] = set()
_ORBAX_READS = r"coroutine '(_read_array_index_and_device_put|_read_and_create_array|_read_shard|async_deserialize)'" \
    r" was never awaited"


def _failed_read(e: BaseException | None) -> bool:
    """Whether e, its cause or its context was raised in orbax's code or names a folder of _QUIET_FOLDERS (what
    TensorStore raises under orbax names the file it could not read)."""
    return any(any(folder in str(x) for folder in _QUIET_FOLDERS)
               or any("orbax" in code.co_filename for code in _codes(x.__traceback__)) for x in _chain(e))


def _read_noise(unraisable) -> bool:
    """Whether an unraisable exception is a failed read's leftover: a read coroutine's, one `_failed_read` tells, or
    TensorStore's callback of a read that finished after orbax closed its event loop ("Event loop is closed" in
    asyncio's call_soon_threadsafe, with no object)."""
    code = getattr(unraisable.object, "cr_code", None)
    if (code is not None and "orbax" in code.co_filename) or _failed_read(unraisable.exc_value):
        return True
    return (unraisable.object is None and isinstance(unraisable.exc_value, RuntimeError)
            and str(unraisable.exc_value) == "Event loop is closed"
            and any(code.co_name == "call_soon_threadsafe" for code in _codes(unraisable.exc_traceback)))


class _DropFailedReads(logging.Filter):
    """asyncio's "... exception was never retrieved" of a failed read's tasks and futures (`_failed_read`)."""

    def filter(self, record):
        first = record.getMessage().split("\n", 1)[0]
        return not ("exception was never retrieved" in first and record.exc_info and _failed_read(record.exc_info[1]))


def _quiet_failed_reads(folder: str) -> Callable[[], None]:
    """Drops what Python prints of orbax's failed reads of the checkpoints in `folder` as they are collected or
    finish late: unraisable exceptions (`_read_noise`), asyncio's never-retrieved task and future exceptions
    (`_DropFailedReads`) and the RuntimeWarning of read coroutines never awaited. One truncated checkpoint printed 4
    to 1,227 lines of tracebacks and TensorStore specs around the one warning `_resume` gives, some while training
    went on. Every other unraisable exception goes to the hook there was, every other record of asyncio's logger is
    logged. Returns what undoes it (`_resume` calls it when no checkpoint failed: a run that read none damaged keeps
    Python's own reporting)."""
    path = os.path.abspath(folder)
    added = path not in _QUIET_FOLDERS
    _QUIET_FOLDERS.add(path)
    saved_filters = list(warnings.filters)
    warnings.filterwarnings("ignore", message=_ORBAX_READS, category=RuntimeWarning)
    asyncio_log = logging.getLogger("asyncio")
    drop = None
    if not any(isinstance(f, _DropFailedReads) for f in asyncio_log.filters):
        drop = _DropFailedReads()
        asyncio_log.addFilter(drop)
    previous = sys.unraisablehook
    hook = None
    if not getattr(previous, "_drops_failed_reads", False):
        def hook(unraisable):
            if not _read_noise(unraisable):
                previous(unraisable)

        hook._drops_failed_reads = True
        sys.unraisablehook = hook

    def undo():
        if added:
            _QUIET_FOLDERS.discard(path)
        warnings.filters[:] = saved_filters
        if drop is not None:
            asyncio_log.removeFilter(drop)
        if hook is not None and sys.unraisablehook is hook:
            sys.unraisablehook = previous

    return undo


def _resume(mngr, out_dir: str, tc: TrainConfig, expected: dict, pparams, opt_state):
    """See `_find_checkpoint`; the leftovers of orbax's failed reads of a damaged checkpoint are not printed (for the
    rest of the process: late reads finish while training goes on)."""
    undo = _quiet_failed_reads(os.path.join(out_dir, CHECKPOINTS))
    *found, damaged = _find_checkpoint(mngr, out_dir, tc, expected, pparams, opt_state)
    gc.collect()  # the failed reads' coroutines, now
    if not damaged:
        undo()
    return tuple(found)


def _describe(e: BaseException) -> str:
    """An exception's type and first line (at most 160 characters), kept instead of the exception: its traceback
    holds orbax's failed read coroutines, collected once it is dropped."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def _find_checkpoint(mngr, out_dir: str, tc: TrainConfig, expected: dict, pparams, opt_state):
    """(step, manager, (params, opt_state), damaged) of the newest checkpoint that reads back, or (None, manager,
    None, False) without one; damaged: whether a newer one failed to read back. A checkpoint that does not read back
    (a run killed while writing it, a damaged disk; or arrays that read back other than the digest written with
    them, `state_digest`) is moved to OUT/checkpoints-damaged/ with a warning and the next older one is tried; none
    readable is a TrainError. A readable checkpoint of another configuration is a TrainError (`_check_resume`), never
    skipped; a failure that is not the checkpoint's (`_not_damage`: memory, the device, an OSError such as EMFILE or
    EACCES) propagates, nothing moved."""
    where = os.path.join(out_dir, CHECKPOINTS)
    damaged = []
    found = None
    for step in sorted(mngr.all_steps(), reverse=True):
        try:
            meta = _read_meta(mngr, step)
        except Exception as e:  # noqa: BLE001  (orbax raises many kinds for a damaged folder)
            if _not_damage(e):
                raise
            damaged.append((step, _describe(e)))
            continue
        _check_resume(meta, expected, where)
        try:
            found = (step, _restore(mngr, step, pparams, opt_state, meta.get("state_digest")))
            break
        except Exception as e:  # noqa: BLE001
            if _not_damage(e):
                raise
            damaged.append((step, _describe(e)))
    if not damaged:
        return (None, mngr, None, False) if found is None else (found[0], mngr, found[1], False)
    listed = "; ".join(f"step {s}: {why}" for s, why in damaged)
    if found is None:
        raise TrainError(f"no checkpoint in {where} reads back ({listed}); delete the damaged step folders to start "
                         "over, or use another --out")
    mngr.close()
    aside = os.path.join(out_dir, CHECKPOINTS + "-damaged")
    os.makedirs(aside, exist_ok=True)
    for s, _ in damaged:
        os.replace(os.path.join(where, str(s)), os.path.join(aside, f"{s}-{int(time.time())}"))
    warnings.warn(f"checkpoints that do not read back were moved to {aside} ({listed}); resuming from step "
                  f"{found[0]}", stacklevel=3)
    return found[0], _manager(out_dir, tc), found[1], True


def read_checkpoint_meta(out_dir: str) -> dict | None:
    """The latest checkpoint's metadata in `out_dir`, or None when there is none."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.path.join(out_dir, CHECKPOINTS))
    if not os.path.isdir(path):
        return None
    mngr = ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(read_only=True))
    try:
        step = mngr.latest_step()
        return None if step is None else _read_meta(mngr, step)
    finally:
        mngr.close()


# ----------------------------------------------------------------------------------------------- the run


@dataclasses.dataclass
class TrainResult:
    """params: the predictor's final params; losses: [(step, loss)] of the steps this call ran; start_step: the
    step it resumed from (0 for a fresh run); last_step: the last completed step; stopped_early: max_seconds hit."""

    params: Any
    pcfg: PredictorConfig
    losses: list
    start_step: int
    last_step: int
    stopped_early: bool
    seconds: float


def _rewrite_log(path: str, upto: int) -> None:
    """Keeps the loss log's lines of steps <= upto (a resumed run re-logs the steps after its checkpoint). A last
    line cut short (a run killed mid-write, a full disk) is dropped; an unreadable line before it is an error. The
    kept lines go to a temporary file beside the log, renamed over it: a run killed meanwhile leaves the whole log."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = [ln for ln in f if ln.strip()]
    kept = []
    for i, ln in enumerate(lines):
        try:
            step, _ = _loss_record(ln)
        except (KeyError, TypeError, ValueError) as e:  # (json's errors are ValueErrors)
            if i == len(lines) - 1:
                break  # the line the interrupted run was writing: its step is logged again
            raise TrainError(f"{path} line {i + 1} is not a loss record ({e}): fix or delete that line to resume")
        if step <= upto:
            kept.append(ln if ln.endswith("\n") else ln + "\n")
    write_replace(path, "".join(kept).encode())


def _loss_record(line: str) -> tuple[int, float]:
    """(step, loss) of a loss log line; KeyError, TypeError or ValueError (json's errors are ValueErrors) when the line
    is not a loss record."""
    rec = json.loads(line)
    step, loss = rec["step"], rec["loss"]
    if (isinstance(step, bool) or not isinstance(step, int) or isinstance(loss, bool)
            or not isinstance(loss, (int, float))):
        raise TypeError(f"step {step!r} and loss {loss!r}: expected an integer and a number")
    return step, float(loss)


def last_logged_loss(out_dir: str) -> float | None:
    """The loss of the last line of out_dir's loss log (the last completed step's), None without one; TrainError
    naming the line when it is not a loss record."""
    path = os.path.join(out_dir, LOSS_LOG)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        lines = [(i, ln) for i, ln in enumerate(f, 1) if ln.strip()]
    if not lines:
        return None
    i, ln = lines[-1]
    try:
        return _loss_record(ln)[1]
    except (KeyError, TypeError, ValueError) as e:
        raise TrainError(f"{path} line {i} is not a loss record ({type(e).__name__}: {e}): fix or delete that "
                         "line") from None


def _checkpoint_on_interrupt(mngr, step: int, save: Callable[[], None]) -> None:
    """The interrupt path's checkpoint of `step`, the last completed one. Skipped when the folder holds that step
    already: the interrupt may have arrived during or just after its periodic save, and orbax refuses a step twice
    (StepAlreadyExistsError, which would replace the interrupt). The manager's own list can name a step whose save
    the interrupt cut short, so the folder is read again after the writes in flight end. A save that fails is a
    warning: the interrupt is what propagates, and a resumed run starts from the newest checkpoint there is."""
    try:
        mngr.wait_until_finished()
        mngr.reload()
        if step not in mngr.all_steps():
            save()
    except Exception as e:  # noqa: BLE001
        warnings.warn(f"no checkpoint of step {step} was saved on the interrupt ({type(e).__name__}: {e}); a resumed "
                      "run starts from the newest checkpoint there is", stacklevel=3)


def _close(mngr, quiet: bool) -> None:
    """Waits for the manager's writes and closes it. quiet (an exception is already propagating): a failure here is a
    warning, so that it does not replace that exception."""
    try:
        mngr.close()  # waits for the writes in flight first
    except Exception as e:  # noqa: BLE001
        if not quiet:
            raise
        warnings.warn(f"closing the checkpoint manager failed ({type(e).__name__}: {e})", stacklevel=3)


def check_target(out_dir: str, loss_impl: str | None, platform: str, interpret: bool = False) -> None:
    """Refuses, before any work: an out_dir that is a file, or whose `checkpoints` is not a folder or `loss.jsonl` not
    a file (orbax's save thread failed there and the run hung after its steps); a Pallas loss kernel (`loss_impl`
    "gpu" or "tpu") of another platform than the devices' (unless `interpret`); and an out_dir that holds another
    method's artifact, which the export would replace (an unreadable artifact.json, an export cut short, is this
    run's to rewrite)."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise TrainError(f"out_dir {out_dir!r} is a file: expected a folder (new, or this run's own)")
    for name, folder, what in ((CHECKPOINTS, True, "the folder of the run's checkpoints"),
                               (LOSS_LOG, False, "the run's loss log, a file")):
        path = os.path.join(out_dir, name)
        if os.path.lexists(path) and os.path.isdir(path) != folder:
            raise TrainError(f"{path!r} is {'not a folder' if folder else 'a folder'}, where the run keeps {what}: "
                             "move it aside, or use another --out")
    if loss_impl in ("gpu", "tpu") and not interpret and platform != loss_impl:
        raise TrainError(f"loss_impl={loss_impl!r} (--loss-impl) is the Pallas {loss_impl.upper()} kernel, but the "
                         f"devices are {platform}: expected 'xla' or the devices' own (the default)")
    try:
        check_artifact_target(out_dir, ARTIFACT_KIND, "training")
    except ArtifactError as e:
        raise TrainError(str(e)) from None


def _is_export(out_dir: str, fingerprint: str, params, step: int) -> bool:
    """Whether out_dir holds this run's artifact already: a butler artifact of `fingerprint` that records `step`
    steps and whose arrays equal `params`'."""
    try:
        art = load_artifact(out_dir, ARTIFACT_KIND, fingerprint)
    except ArtifactError:
        return False
    want = flatten_params(params)
    return (isinstance(art.meta, dict) and art.meta.get("steps") == step and sorted(art.arrays) == sorted(want)
            and all(art.arrays[k].shape == v.shape and np.array_equal(art.arrays[k], v) for k, v in want.items()))


class Terminated(KeyboardInterrupt):
    """SIGTERM during `train`'s steps: handled as Ctrl-C (a checkpoint of the last completed step), then raised."""


class _SigtermControl:
    """What `_sigterm_interrupts` yields: `defer()` holds a later SIGTERM back until the block ends."""

    def __init__(self):
        self.deferred = False
        self.pending: str | None = None

    def defer(self) -> None:
        self.deferred = True


@contextlib.contextmanager
def _sigterm_interrupts():
    """Within: SIGTERM raises `Terminated` in the main thread (elsewhere, where no handler can be set, unchanged).
    After the yielded control's `defer()` (every step done: the final checkpoint, its write and the artifact are
    left), a SIGTERM is held back and raised as `Terminated` when the block ends, once that work is on disk."""
    ctl = _SigtermControl()
    if threading.current_thread() is not threading.main_thread():
        yield ctl
        return

    def handler(signum, frame):
        what = f"signal {signal.Signals(signum).name} during training"
        if ctl.deferred:
            ctl.pending = what + " (after its last step: the checkpoint and the artifact were written first)"
            return
        raise Terminated(what)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield ctl
    finally:
        signal.signal(signal.SIGTERM, previous)
    if ctl.pending is not None:
        raise Terminated(ctl.pending)


def train(cfg: ModelConfig, model_params, *, fingerprint: str, chunks: np.ndarray, out_dir: str, tc: TrainConfig,
          pcfg: PredictorConfig, model_name: str = "", on_step: Callable[[int, float], None] | None = None,
          progress: bool = True, max_seconds: float | None = None, devices=None, fsdp: bool = True,
          artifact_meta: dict | None = None) -> TrainResult:
    """Trains (or resumes training) the predictor and writes checkpoints, the loss log and the final artifact.

    Args:
      cfg, model_params: the frozen model. fingerprint: its `jsparse.artifacts.model_fingerprint`.
      chunks: i32[S, seq_len] training chunks (train/data.py), ids in [0, vocab_size). out_dir: checkpoints, loss
        log and artifact.
      tc: hyper-parameters. pcfg: the predictor's shape (train/predictor.py presets).
      on_step: called as on_step(step, loss) after every completed step (step counts from 1); an exception it
        raises ends the run like a crash (a KeyboardInterrupt saves a checkpoint of that step first; so does a
        SIGTERM, raised as `Terminated`).
      max_seconds: stop after this much wall time (saving a checkpoint and the artifact), None for no limit.
      devices: the devices of the data-parallel mesh (default: all).
      fsdp: on more than one device, keep the frozen model's params sharded over 'data' between steps (each
        device holds 1/n; gathered for each step's forward), else replicated. Same results either way.
      artifact_meta: more metadata for the exported artifact (the CLI's: the training text, `corpus_meta`, so that
        an evaluation on that text is refused). A call that trains nothing (a finished run) does not export when
        out_dir holds the run's artifact already (`_is_export`): that artifact, with whatever metadata was added to
        it since (`dense_set`, `dense_set_calibration`), is kept as it is, and artifact_meta is not applied.
    Returns:
      TrainResult.
    """
    mesh = data_mesh(devices)
    tc.validate(cfg, mesh.size)
    pcfg.check_model(cfg)
    chunks = np.asarray(chunks, np.int32)
    if chunks.ndim != 2 or chunks.shape[1] != tc.seq_len:
        raise TrainError(f"chunks have shape {chunks.shape}: expected [S, seq_len={tc.seq_len}]")
    lo, hi = (int(chunks.min()), int(chunks.max())) if chunks.size else (0, 0)
    if not 0 <= lo <= hi < cfg.vocab_size:  # (else a nan loss)
        bad = hi if hi >= cfg.vocab_size else lo
        raise TrainError(f"the chunks hold token id {bad}: expected ids in [0, {cfg.vocab_size}), the model's "
                         "vocabulary (a tokenizer of another model?)")
    stream = ChunkStream(chunks, tc.batch_size, tc.seed)
    check_target(out_dir, tc.loss_impl, mesh.devices.flat[0].platform, tc.interpret)
    os.makedirs(out_dir, exist_ok=True)
    if max_seconds is not None and not max_seconds > 0:
        raise TrainError(f"max_seconds={max_seconds!r}: expected a positive number of seconds (None: no limit)")
    # The fingerprint is the same for the f32 and bf16 loads of a checkpoint; a resumed run keeps the dtype too.
    expected = {"model_fingerprint": fingerprint, "model_dtype": str(jax.tree_util.tree_leaves(model_params)[0].dtype),
                "predictor_config": pcfg.to_dict(), "data_fingerprint": stream.fingerprint(),
                "train_config": tc.identity(), "num_chunks": stream.num_chunks}

    replicated = NamedSharding(mesh, P())
    batch_sharding = NamedSharding(mesh, P("data"))
    tx = make_optimizer(tc)
    pparams = jax.device_put(init_params(pcfg, jax.random.key(tc.seed)), replicated)
    opt_state = jax.device_put(tx.init(pparams), replicated)
    mdims = fsdp_dims(model_params, mesh.size) if fsdp and mesh.size > 1 else None
    mparams = jax.device_put(model_params, replicated if mdims is None else jax.tree_util.tree_map(
        lambda d: NamedSharding(mesh, fsdp_spec(d)), mdims))
    mngr = _manager(out_dir, tc)
    log_path = os.path.join(out_dir, LOSS_LOG)
    start = 0
    latest, mngr, restored = _resume(mngr, out_dir, tc, expected, pparams, opt_state)
    if latest is not None:
        pparams, opt_state = restored
        start = int(latest)
    _rewrite_log(log_path, start)

    def meta(step: int) -> dict:
        return {**expected, "fingerprint_scheme": FINGERPRINT_SCHEME, "step": step,
                "data_position": stream.position(step), "seed": tc.seed,
                "num_chunks": stream.num_chunks, "model_name": model_name}

    step_fn = make_train_step(mesh, cfg, pcfg, tc, mdims)
    schedule = make_schedule(tc)
    tokens_per_step = tc.batch_size * tc.seq_len
    losses: list = []
    t_start = time.perf_counter()
    step = start
    stopped_early = False
    from tqdm.auto import tqdm

    bar = tqdm(total=tc.steps, initial=start, disable=not progress, unit="step", dynamic_ncols=True,
               desc="train-predictor")
    completed = False
    with _sigterm_interrupts() as sigterm:
        try:
            try:
                with open(log_path, "a") as log:
                    while step < tc.steps:
                        t0 = time.perf_counter()
                        tokens = jax.device_put(stream.batch(step), batch_sharding)
                        new_p, new_o, loss, gnorm = step_fn(pparams, opt_state, mparams, tokens)
                        loss = float(loss)  # waits for the step
                        if not math.isfinite(loss):
                            raise TrainError(f"the loss is {loss} at step {step + 1}: lower --lr or check the data")
                        dt = time.perf_counter() - t0
                        # The line before the step counts: an interrupt in between re-runs the step (the resumed run
                        # drops the line, `_rewrite_log`), where the other order would checkpoint it without its line.
                        rec = {"step": step + 1, "loss": loss, "lr": float(schedule(step)), "grad_norm": float(gnorm),
                               "tokens_per_s": tokens_per_step / dt, "seconds": dt}
                        log.write(json.dumps(rec) + "\n")
                        log.flush()
                        pparams, opt_state, step = new_p, new_o, step + 1
                        losses.append((step, loss))
                        bar.update(1)
                        bar.set_postfix(loss=f"{loss:.4g}", tok_s=f"{tokens_per_step / dt:,.0f}")
                        if step % tc.checkpoint_every == 0 or step == tc.steps:
                            _save(mngr, step, pparams, opt_state, meta(step))
                        if on_step is not None:
                            on_step(step, loss)
                        if max_seconds is not None and time.perf_counter() - t_start > max_seconds and step < tc.steps:
                            stopped_early = True
                            break
                # Every step is done: a SIGTERM from here on waits for the final checkpoint and the artifact.
                sigterm.defer()
            except KeyboardInterrupt:
                _checkpoint_on_interrupt(mngr, step, lambda: _save(mngr, step, pparams, opt_state, meta(step)))
                raise
            if step not in mngr.all_steps():
                _save(mngr, step, pparams, opt_state, meta(step))
            completed = True
        finally:
            bar.close()
            _close(mngr, quiet=not completed)
        if not (step == start and _is_export(out_dir, fingerprint, pparams, step)):  # (a rerun keeps its artifact)
            final_loss = last_logged_loss(out_dir)
            export_artifact(out_dir, pparams, pcfg, fingerprint, {
                "model": model_name, "steps": step, "planned_steps": tc.steps, "train_config": dataclasses.asdict(tc),
                "data_fingerprint": stream.fingerprint(), "num_chunks": stream.num_chunks, "final_loss": final_loss,
                "stopped_early": stopped_early, "predictor_params": pcfg.num_params(), **(artifact_meta or {})})
    return TrainResult(params=pparams, pcfg=pcfg, losses=losses, start_step=start, last_step=step,
                       stopped_early=stopped_early, seconds=time.perf_counter() - t_start)


def export_artifact(out_dir: str, params, pcfg: PredictorConfig, fingerprint: str, meta: dict) -> None:
    """Writes the predictor as a "butler" artifact (artifact.json + arrays.npz) in out_dir."""
    save_artifact(out_dir, Artifact(kind=ARTIFACT_KIND, fingerprint=fingerprint, arrays=flatten_params(params),
                                    meta={"predictor_config": pcfg.to_dict(), **meta}))
