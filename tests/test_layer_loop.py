"""The decode's layer runs are while loops over the layer index (`models.llama._scan_layers`): the same logits as
the scan, which unrolled decodes and prefill (per-layer outputs) keep."""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

from jsparse.methods.oracle import Oracle
from models import llama
from models.cache import init_cache
from models.config import ModelConfig
from models.params import random_params

CFG = ModelConfig(architecture="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=4,
                  num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512)


def _primitives(jaxpr) -> list[str]:
    out = []
    for eqn in jaxpr.eqns:
        out.append(eqn.primitive.name)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            out += _primitives(sub)
    return out


def test_decode_runs_are_while_loops_with_the_scans_logits():
    params = random_params(CFG, jax.random.key(0), jnp.float32, scale=0.08)
    method = Oracle.build(budget=0.5)  # a dense first layer: runs 0..1 and 1..4, the second from layer 1
    tokens = jax.random.randint(jax.random.key(1), (2, 24), 0, CFG.vocab_size, jnp.int32)
    cache = init_cache(CFG, 2, 64, jnp.float32)
    _, cache, state = llama.prefill(params, CFG, method, tokens, jnp.array([24, 17], jnp.int32), cache,
                                    method.init_state(CFG, 2, 64))
    nxt = jnp.array([[3], [5]], jnp.int32)

    def step(unroll):
        return llama.decode(params, CFG, method, nxt, cache, state, unroll=unroll)[0]
    rolled = _primitives(jax.make_jaxpr(lambda: step(1))().jaxpr)
    unrolled = _primitives(jax.make_jaxpr(lambda: step(2))().jaxpr)
    assert rolled.count("while") == 2 and "scan" not in rolled  # one loop a run, the index its only counter
    assert unrolled.count("scan") == 2
    np.testing.assert_allclose(np.asarray(step(1)), np.asarray(step(2)), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(step(1)), np.asarray(step(True)), rtol=1e-5, atol=1e-5)
