"""Why `jsparse bench model` ran out of memory at 128K, batch 7 on an H200 (it asked for one more buffer the size
of the K cache, 56 GiB): compiles `eval.bench.model.method_decode_steps` for Llama-3.1-8B shapes from shapes alone
(nothing allocated) and reports XLA's memory analysis and its largest temporary buffers with the ops that use them.
Env: METHODS (default dense), CTX (131072), B (7), STEPS (16), OUT. Writes $OUT/decode_memory.json.
"""
import datetime, glob, json, os, re
os.environ.setdefault("XLA_FLAGS", "")
DUMP = "/tmp/jsparse_decode_memory_dump"
os.environ["XLA_FLAGS"] += f" --xla_dump_to={DUMP} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*method_decode_steps.*"
import jax, jax.numpy as jnp  # noqa: E402
from eval.bench.model import bench_method, method_decode_steps  # noqa: E402
from models.cache import KVCache  # noqa: E402
from models.params import random_params, with_layout  # noqa: E402
from models.presets import preset  # noqa: E402
from models.generate import round_up  # noqa: E402

cfg = preset("llama3-8b")
CTX, B, STEPS = int(os.environ.get("CTX", 131072)), int(os.environ.get("B", 7)), int(os.environ.get("STEPS", 16))
res = dict(device=str(jax.devices()[0].device_kind),
           date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), jax=jax.__version__,
           commit=os.environ.get("GIT_COMMIT", ""),
           command="python eval/results/h200/largest_batch/decode_memory.py", context=CTX, batch=B, rows=[])
params = jax.eval_shape(lambda: with_layout(random_params(cfg, jax.random.key(0), jnp.bfloat16), "default"))
cap = round_up(CTX + 2 * STEPS + 1, 256)
shape = (cfg.num_layers, B, cfg.num_kv_heads, cap, cfg.head_dim)
cache = KVCache(k=jax.ShapeDtypeStruct(shape, jnp.bfloat16), v=jax.ShapeDtypeStruct(shape, jnp.bfloat16),
                lengths=jax.ShapeDtypeStruct((B,), jnp.int32))
for name in os.environ.get("METHODS", "dense").split(","):
    method, _ = bench_method(name, cfg, 0.1)
    state = jax.eval_shape(lambda: method.init_state(cfg, B, cap))
    tok = jax.ShapeDtypeStruct((B, 1), jnp.int32)
    c = method_decode_steps.lower(params, method, tok, cache, state, cfg=cfg, steps=STEPS).compile()
    ma = c.memory_analysis()
    row = dict(method=name, cache_bytes_each=int(jnp.dtype(jnp.bfloat16).itemsize * jnp.prod(jnp.array(shape))),
               temp_bytes=ma.temp_size_in_bytes, argument_bytes=ma.argument_size_in_bytes,
               output_bytes=ma.output_size_in_bytes, alias_bytes=ma.alias_size_in_bytes)
    reports = sorted(glob.glob(f"{DUMP}/*method_decode_steps*memory-usage-report.txt"), key=os.path.getmtime)
    if reports:
        row["memory_report_head"] = open(reports[-1]).read().splitlines()[:12]
    assigns = sorted(glob.glob(f"{DUMP}/*method_decode_steps*buffer-assignment.txt"), key=os.path.getmtime)
    if assigns:
        text = open(assigns[-1]).read()
        big = []
        for block in re.split(r"\n(?=allocation \d+:)", text):
            m = re.match(r"allocation (\d+): size (\d+)", block)
            if m and int(m.group(2)) > 2**30 and ", parameter " not in block.splitlines()[0]:
                big.append(block.splitlines()[:40])
        row["temp_allocations_over_1GiB"] = big
    res["rows"].append(row)
    print(json.dumps({k: v for k, v in row.items()}, indent=1)[:3000], flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "decode_memory.json"), "w"), indent=1)
