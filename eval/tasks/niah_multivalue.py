"""Multi-value needle in a haystack (RULER's niah_multivalue): four "special magic numbers" needles share one key;
the question asks for all numbers of that key.

The needles sit at seeded uniform depths (Sample.depth is None). Metric: string_match_all (the fraction of the
four numbers found in the completion).

Differences from RULER: the haystack is the run's ("repeat", "corpus" or a user's file) rather than essays; keys
from this repo's word lists; 48 new tokens instead of 128.
"""

from __future__ import annotations

from eval.tasks import niah
from eval.tasks.base import Task

NAME = "niah_multivalue"
VALUES = 4


def make_samples(tokenizer, length: int, samples: int, seed: int, *, haystack: str = "repeat", chat: bool = False):
    """niah_multivalue samples (see the module docstring)."""
    return niah.make_samples(NAME, tokenizer, length, samples, seed, haystack=haystack, chat=chat, kind="numbers",
                             values_per_key=VALUES)


TASKS = (Task(name=NAME, metric="string_match_all", max_new_tokens=48, make_samples=make_samples,
              doc="retrieve all four numbers hidden under one key"),)
