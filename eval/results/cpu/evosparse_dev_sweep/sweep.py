"""Dev sweep of EvoSparse defaults on SmolLM2: passkey at 3072 (dev seed 1, 4 prompts), ppl at 4096 (Alice, 2 windows)."""
import json, sys, time
import numpy as np, jax
import jsparse
from eval import harness, passkey as pk, ppl
from jsparse.methods.evosparse import EvoSparse, top_heads
from jsparse.artifacts import load_artifact

model = jsparse.load("smollm2")
art = load_artifact("/tmp/evo/art", "evosparse")
prompts = pk.make_prompts(model.tokenizer, 3072, 4, seed=1)
ids = ppl.tokenize_corpus(model.tokenizer, ppl.read_corpus(ppl.DEV_CORPUS))
import os
windows = ppl.make_windows(model.tokenizer, ids, 4096, int(os.environ.get("NWIN", 2)), seed=1)

def build(c, L):
    c = dict(c); label = c.pop("label"); nh = c.pop("heads", 4)
    if label in ("dense",):
        return jsparse.build_method(label, model)
    if label in ("oracle", "quest", "streaming"):
        return jsparse.build_method(label, model, budget=512 / L)
    if c.get("retrieval_fraction", 0.375) > 0:
        return EvoSparse.from_heads(model.cfg, top_heads(art.arrays["scores"], nh), budget=512 / L, **c)
    return EvoSparse(budget=512 / L, **c)

for c in json.loads(sys.argv[1]):
    t = time.time()
    comp = harness.run_passkey(model, build(c, 3072), prompts, 8, 2)
    acc = np.mean([pk.extract_answer(x) == p.key for x, p in zip(comp, prompts)])
    t1 = time.time()
    nll = harness.run_ppl(model, build(c, 4096), windows, "decode", 2, 512)
    print(json.dumps(dict(cfg=c, passkey=float(acc), ppl=ppl.perplexity(nll), pk_s=round(t1 - t), ppl_s=round(time.time() - t1),
                          completions=comp)), flush=True)
