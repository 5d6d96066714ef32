import sys, json, time, functools, itertools, re
sys.path.insert(0, "/tmp/diag")
import numpy as np, jax, jax.numpy as jnp
import jsparse
from probe import Probe
from models import llama
from models.cache import init_cache
from eval import passkey
from jsparse.methods.kascade import roles_from_anchors

import os
jax.config.update("jax_default_matmul_precision", "highest")
m = jsparse.load(os.environ.get("MODEL", "smollm2"), dtype="float32")
cfg, tok = m.cfg, m.tokenizer
art = np.load("artifacts/smollm2/kascade/arrays.npz")
anchors, hmap = art["anchors"], art["head_map"]
L = cfg.num_layers

def corpus_prompts(n, length, seed, book):
    """Needle phrased differently, book filler."""
    text = open(book).read()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    out = []
    for i in range(n):
        rng = np.random.default_rng([seed, length, i])
        key = str(int(rng.integers(10000, 100000)))
        head = passkey.special_prefix(tok) + tok("Below is a long excerpt of a book. Somewhere inside it a secret number is given. Read carefully.", add_special_tokens=False)["input_ids"]
        needle = tok(f" (Note: the secret number is {key}. Keep the secret number {key} in mind.)", add_special_tokens=False)["input_ids"]
        tail = tok("\nQuestion: what is the secret number? Answer: the secret number is", add_special_tokens=False)["input_ids"]
        F = length - len(head) - len(needle) - len(tail)
        s = int(rng.integers(0, len(ids) - F - 1))
        fill = ids[s:s + F]
        d = [0.1, 0.3, 0.5, 0.7, 0.9][i % 5]
        cut = int(d * F)
        toks = head + fill[:cut] + needle + fill[cut:] + tail
        out.append(passkey.PasskeyPrompt(tokens=np.asarray(toks, np.int32), key=key, depth=d, needle_start=len(head) + cut,
                                         needle_len=len(needle), filler_start=len(head), filler_tokens=F))
    return out


def run_variant(method, prompts, new=8):
    res = []
    stats = []
    for p in prompts:
        T = len(p.tokens)
        meth = method.replace(needle=jnp.asarray([p.needle_start, p.needle_len], jnp.int32))
        tokens = jnp.asarray(p.tokens)[None]
        lengths = jnp.asarray([T], jnp.int32)
        cache = init_cache(cfg, 1, T + new, m.params.embed.dtype)
        logits, cache, st = PREFILL(m.params, meth, tokens, lengths, cache)
        out = [int(jnp.argmax(logits[0]))]
        for _ in range(new - 1):
            lg, cache = DECODE(m.params, meth, jnp.asarray([[out[-1]]], jnp.int32), cache)
            out.append(int(jnp.argmax(lg[0, 0])))
        comp = tok.decode(out, skip_special_tokens=True)
        res.append(passkey.is_correct(comp, p.key))
        stats.append({k: np.asarray(getattr(st, k)).tolist() for k in ("own_cov", "used_cov", "needle_used", "needle_own", "needle_rank", "needle_mass")})
    return res, stats

@functools.partial(jax.jit)
def PREFILL(params, meth, tokens, lengths, cache):
    return llama.prefill(params, cfg, meth, tokens, lengths, cache, None)

@functools.partial(jax.jit)
def DECODE(params, meth, tokens, cache):
    lg, cache, _ = llama.decode(params, cfg, meth, tokens, cache, None)
    return lg, cache

def make(anch, **kw):
    roles = roles_from_anchors(L, anch)
    from jsparse.methods.kascade_calibration import head_map_for
    use_map = kw.pop("use_map", True)
    hm = (hmap if list(anch) == list(anchors) else head_map_for(art["similarity"], anch)) if use_map else np.tile(np.arange(cfg.num_kv_heads), (L, 1))
    return Probe(roles=jnp.asarray(roles), head_map=jnp.asarray(hm, jnp.int32), needle=jnp.zeros(2, jnp.int32), **kw)

if __name__ == "__main__":
    which = sys.argv[1]
    n = int(sys.argv[2]); length = int(sys.argv[3])
    variants = json.loads(sys.argv[4])
    out_path = sys.argv[5]
    if which == "repo":
        prompts = passkey.make_prompts(tok, length, n, seed=0)
    else:
        prompts = corpus_prompts(n, length, 0, which)
    results = {}
    for name, spec in variants.items():
        t = time.time()
        anch = list(range(L)) if spec.pop("anchors", "art") == "all" else list(anchors)
        ok, st = run_variant(make(anch, **spec), prompts)
        results[name] = {"ok": ok, "stats": st}
        agg = {k: np.mean([s[k] for s in st], 0) for k in st[0]}
        print(f"{name:28s} {sum(ok)}/{len(ok)}  used_cov(mean over layers) {agg['used_cov'].mean():.3f} own {agg['own_cov'].mean():.3f} "
              f"needle_used {np.round(agg['needle_used'],2).tolist()} ({time.time()-t:.0f}s)", flush=True)
    json.dump(results, open(out_path, "w"))
