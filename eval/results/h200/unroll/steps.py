"""The rolled and the fully unrolled layer scan, timed over 16 and over 64 decode steps per call (issue 24): H200.

profile_unrolled.py found the unrolled step without idle time at the layer boundaries, but with a lead-in of about
2 ms that each call pays before its first layer (the rolled scan's: about 0.45 ms). `jsparse bench model` times one
call of 16 steps, so that lead-in weighs 0.13 ms a step there, and less in `generate`'s one loop over all tokens.
Here: `method_rows` of METHODS (env, default dense,streaming,kascade) at 100K, batch 4, budget 0.1 for each round
of ROUNDS (env, default "1:16,T:16,1:64,T:64,1:16,T:16,1:64,T:64": unroll:steps), `jax.clear_caches()` between
rounds. The library's XLA flags are set first, as `jsparse bench model` does (`jsparse.xla_flags`); NOFLAGS=1
leaves them out (steps_noflags.json was such a run). Writes $OUT/steps.json and prints a table.
Usage (GPU): OUT=... PYTHONPATH=. python eval/results/h200/unroll/steps.py
"""
import os

from eval.results.h200.unroll.unroll import run_rounds, set_unroll


def setup(r: str) -> int:
    """Round "unroll:steps": `set_unroll(unroll)` (the decode's `unroll` default, jax's caches cleared), returns the
    steps."""
    unroll, steps = r.split(":")
    set_unroll(unroll)
    return int(steps)


def main():
    if os.environ.get("NOFLAGS") != "1":
        from jsparse.xla_flags import set_xla_flags
        set_xla_flags()
    run_rounds("round", setup, "eval/results/h200/unroll/steps.py", "steps.json", "dense,streaming,kascade",
               "1:16,T:16,1:64,T:64,1:16,T:16,1:64,T:64", xla_flags=os.environ.get("XLA_FLAGS", ""))


if __name__ == "__main__":
    main()
