"""Where the unrolled decode step's time goes (issue 24): H200 experiment beside unroll.py.

`jsparse bench profile_decode_step` of METHOD (env, default streaming) at 100K, batch 4, with `models.llama.decode`'s
`unroll` default set to True (the whole layer scan unrolled) and the CUDA graphs kept while tracing, then the trace's
kernel sequence (../layer_seq/seq.py), written to $OUT/prof_unrolled_METHOD.json and $OUT/seq_unrolled_METHOD.json.
Usage (GPU): OUT=... PYTHONPATH=. python eval/results/h200/unroll/profile_unrolled.py
"""
import os
import runpy
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_enable_command_buffers_during_profiling=true").strip()

from eval.bench import profile_decode_step  # noqa: E402
from models import llama  # noqa: E402


def main():
    out, m = os.environ.get("OUT", "/tmp"), os.environ.get("METHOD", "streaming")
    llama.decode.__kwdefaults__["unroll"] = True
    trace = f"/tmp/tr_unrolled_{m}"
    profile_decode_step.main(["--method", m, "--context", "100000", "--batch", "4", "--steps", "2", "--top", "30",
                              "--time", f"dense,{m}", "--trace-dir", trace,
                              "--out", os.path.join("/tmp", f"prof_unrolled_{m}.json")])
    os.system(f"cp /tmp/prof_unrolled_{m}.json {out}/")
    sys.argv = ["seq.py", trace, os.path.join(out, f"seq_unrolled_{m}.json")]
    runpy.run_path(os.path.join(os.path.dirname(__file__), "..", "layer_seq", "seq.py"), run_name="__main__")


if __name__ == "__main__":
    main()
