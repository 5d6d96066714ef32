"""The ordered kernel sequence of a traced decode step: every device op of the newest Perfetto trace under a folder
(written by `jsparse bench profile_decode_step --trace-dir DIR`), sorted by start time, as
[name, start us, duration us, idle us before it], so that one layer's kernels and the gaps between them can be read.

    PYTHONPATH=. python eval/results/h200/layer_seq/seq.py TRACE_DIR OUT.json
"""
import json
import sys

from eval.bench.profile_decode_step import device_ops, idle_before


def main(trace_dir: str, out: str) -> None:
    path, _, ops = device_ops(trace_dir)
    t0 = ops[0][0]
    rows = [[name[:80], round(ts - t0, 2), round(dur, 2), round(idle, 2)]
            for (ts, dur, name), idle in zip(ops, idle_before(ops))]
    end = max(ts + dur for ts, dur, _ in ops)
    with open(out, "w") as f:
        json.dump({"command": "python " + " ".join(sys.argv), "trace": path, "ops": rows}, f)
    print(f"{out}: {len(rows)} ops over {end - t0:.0f} us")


if __name__ == "__main__":
    main(*sys.argv[1:])
