"""Which heads of which TSA sparse layers drop the passkey needle's tokens (SmolLM2, 4K, the eval's prompts)."""
import sys
import jax, jax.numpy as jnp, numpy as np
import jsparse
from eval import passkey as pk
from models import llama
from models.cache import init_cache

model = jsparse.load("smollm2")
cfg, params = model.cfg, model.params
prompts = pk.make_prompts(model.tokenizer, 4096, 4, 0, pk.DEFAULT_DEPTHS)
inv = llama.rope_inv_freq(cfg)
for tau in [float(t) for t in sys.argv[1:]]:
    m = jsparse.build_method("tsa", model, artifact="artifacts/smollm2/tsa", tau=tau)
    for p in prompts:
        toks = jnp.asarray(p.tokens)[None]
        T = toks.shape[1]
        lengths = jnp.asarray([T], jnp.int32)
        _, _, st, (inputs, _) = jax.jit(lambda t: llama.prefill(params, cfg, m, t, lengths, init_cache(cfg, 1, T, jnp.float32),
                                        m.init_state(cfg, 1, T), return_hidden=True))(toks)
        # The key's digits: the needle tokens that hold the key.
        needle = np.arange(p.needle_start, p.needle_start + p.needle_len)
        out = []
        for l in m.layers(cfg.num_layers):
            lp = jax.tree_util.tree_map(lambda a: a[l], params.layers)
            h = llama.rms_norm(inputs[l], lp.attn_norm, cfg.rms_norm_eps)
            q, k, _ = llama.qkv_projection(cfg, lp, h, jnp.arange(T)[None], inv)
            counts, sel = m.select(q, k, lengths)
            keep = np.asarray(sel.keep)[0][:, needle]  # [H, needle]
            out.append(f"L{l}:{(~keep).sum()}/{keep.size}")
        print(f"tau={tau} depth={p.depth} needle {p.needle_len} tokens at {p.needle_start}; dropped (head,token) pairs:",
              " ".join(out), flush=True)
