"""eval.bench.common's timing helpers."""

import time

import jax.numpy as jnp

from eval.bench.common import pipelined_ms, time_ms


def _sleeper(calls, ms):
    def fn(x):
        calls.append(1)
        time.sleep(ms / 1e3)
        return x + 1
    return fn


def test_pipelined_ms_calls_warmup_plus_n_times_and_averages_over_n():
    calls = []
    got = pipelined_ms(_sleeper(calls, 2.0), (jnp.ones(3),), n=5, warmup=2)
    assert len(calls) == 7
    assert 2.0 <= got < 50.0


def test_time_ms_is_the_median_of_blocked_calls():
    calls = []
    got = time_ms(_sleeper(calls, 2.0), jnp.ones(3), warmup=1, iters=4)
    assert len(calls) == 5
    assert 2.0 <= got < 50.0
