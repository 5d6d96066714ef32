"""Dense end-to-end benchmark of the model substrate: prefill time and decode tokens/s beside the roofline.

Random weights of a real model shape (default Llama-3.1-8B), bf16, dense attention (cuDNN on GPU). For each
context and batch: prefill of the whole context (time, TFLOP/s) and decode steps with a cache holding the
context (tokens/s), beside the roofline: prefill FLOPs over the measured matmul rate, decode bytes per step
(weights + KV read) over the measured HBM bandwidth.

    python -m eval.bench.model --shape llama3-8b --context 8192,32768 --batch 1,8 --out bench.json
"""

from __future__ import annotations

import argparse
import functools
import os

import jax
import jax.numpy as jnp

from eval.bench import common as bm
from jsparse.xla_flags import GPU_XLA_FLAGS
from jsparse.methods import make_method
from models import llama
from models.cache import KVCache, init_cache
from models.generate import round_up
from models.params import random_params
from models.presets import preset


def param_bytes(params) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params))


def decode_bytes(cfg, params, batch: int, context: int) -> int:
    """Bytes a decode step must read: every weight once (one embedding row only) + the K/V of the context."""
    emb = params.embed.size * params.embed.dtype.itemsize
    weights = param_bytes(params) - emb + cfg.hidden_size * 2 * batch
    if params.lm_head is None:
        weights += emb  # tied: the LM head reads the embedding matrix
    kv = 2 * cfg.num_layers * batch * cfg.num_kv_heads * context * cfg.head_dim * 2
    return weights + kv


def prefill_flops(cfg, batch: int, T: int) -> float:
    n_matmul = cfg.num_params() - cfg.vocab_size * cfg.hidden_size  # embedding lookup is no matmul
    attn = 2 * 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * T * T / 2
    return batch * (2 * n_matmul * T + attn)


@functools.partial(jax.jit, static_argnames=("cfg", "steps"), donate_argnames=("cache",))
def decode_steps(params, method, tok, cache, *, cfg, steps):
    def body(_, carry):
        tok, cache = carry
        logits, cache, _ = llama.decode(params, cfg, method, tok, cache, None)
        return jnp.argmax(logits, -1).astype(jnp.int32), cache
    return jax.lax.fori_loop(0, steps, body, (tok, cache))


@functools.partial(jax.jit, static_argnames=("cfg",))
def prefill_only(params, method, tokens, *, cfg):
    B, T = tokens.shape
    cache = init_cache(cfg, B, T, params.embed.dtype)
    logits, cache, _ = llama.prefill(params, cfg, method, tokens, jnp.full((B,), T, jnp.int32), cache, None)
    return logits


def filled_cache(cfg, batch, context, capacity, dtype):
    """A cache whose first `context` positions hold random (tiled) keys and values."""
    tile = jax.random.normal(jax.random.key(3), (cfg.num_layers, batch, cfg.num_kv_heads, 256, cfg.head_dim), dtype)
    k = jnp.tile(tile, (1, 1, 1, capacity // 256, 1))
    return KVCache(k=k, v=k * 0.5, lengths=jnp.full((batch,), context, jnp.int32))


def run(shape: str, contexts, batches, steps: int = 16, out: str | None = None):
    cfg = preset(shape)
    facts = bm.device_facts()
    hbm = bm.measure_hbm_gbs()
    mm = bm.measure_matmul_tflops()
    params = random_params(cfg, jax.random.key(0), jnp.bfloat16)
    method = make_method("dense")
    rows = []
    for context in contexts:
        for batch in batches:
            row = {"context": context, "batch": batch}
            tokens = jax.random.randint(jax.random.key(1), (batch, context), 0, cfg.vocab_size)
            try:
                ms = bm.time_ms(lambda t: prefill_only(params, method, t, cfg=cfg), tokens, warmup=1, iters=3)
                flops = prefill_flops(cfg, batch, context)
                row.update(prefill_ms=ms, prefill_tflops=flops / (ms * 1e-3) / 1e12,
                           prefill_roofline_ms=flops / (mm * 1e12) * 1e3)
            except Exception as e:  # noqa: BLE001 - record out-of-memory and go on
                row["prefill_error"] = str(e).splitlines()[0][:200]
            try:
                capacity = round_up(context + steps + 1, 256)
                cache = filled_cache(cfg, batch, context, capacity, jnp.bfloat16)
                tok = jnp.zeros((batch, 1), jnp.int32)
                tok, cache = decode_steps(params, method, tok, cache, cfg=cfg, steps=steps)  # compile + warm
                jax.block_until_ready(tok)
                cache = KVCache(k=cache.k, v=cache.v, lengths=jnp.full((batch,), context, jnp.int32))
                import time
                t0 = time.perf_counter()
                tok, cache = decode_steps(params, method, tok, cache, cfg=cfg, steps=steps)
                jax.block_until_ready(tok)
                step_ms = (time.perf_counter() - t0) * 1e3 / steps
                nbytes = decode_bytes(cfg, params, batch, context + steps // 2)
                row.update(decode_step_ms=step_ms, decode_tokens_per_s=batch / (step_ms * 1e-3),
                           decode_roofline_ms=nbytes / (hbm * 1e9) * 1e3,
                           decode_roofline_tokens_per_s=batch / (nbytes / (hbm * 1e9)),
                           decode_gbs=nbytes / (step_ms * 1e-3) / 1e9)
                del cache
            except Exception as e:  # noqa: BLE001
                row["decode_error"] = str(e).splitlines()[0][:200]
            rows.append(row)
            print(row, flush=True)
    payload = {**facts, "benchmark": "model_dense", "xla_flags": os.environ.get("XLA_FLAGS", ""), "shape": shape, "dtype": "bfloat16", "weights": "random",
               "measured_hbm_gbs": hbm, "measured_matmul_tflops": mm, "param_bytes": param_bytes(params),
               "decode_steps_timed": steps, "rows": rows}
    if out:
        bm.write_json(out, payload)
    print(bm.table(rows, ["context", "batch", "prefill_ms", "prefill_tflops", "prefill_roofline_ms",
                          "decode_step_ms", "decode_tokens_per_s", "decode_roofline_tokens_per_s", "decode_gbs"]))
    return payload


def main(argv=None, prog=None):
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama3-8b", help="model shape preset (llama3-8b, qwen3-8b)")
    p.add_argument("--context", default="8192,32768", help="comma-separated context lengths")
    p.add_argument("--batch", default="1,8", help="comma-separated batch sizes")
    p.add_argument("--steps", type=int, default=16, help="decode steps timed per case")
    p.add_argument("--out", default=None, help="JSON file to write")
    p.add_argument("--xla-flags", default=" ".join(GPU_XLA_FLAGS),
                   help="XLA_FLAGS for this run, set before the backend starts (default: jsparse.xla_flags.GPU_XLA_FLAGS, "
                        "cuBLAS GEMMs reading the stacked weights in place; see eval/results/h100/bench_decode_step.json)")
    a = p.parse_args(argv)
    if a.xla_flags:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + a.xla_flags).strip()
    run(a.shape, [int(x) for x in a.context.split(",")], [int(x) for x in a.batch.split(",")], a.steps, a.out)


if __name__ == "__main__":
    main()
