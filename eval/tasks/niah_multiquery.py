"""Multi-query needle in a haystack (RULER's niah_multiquery): four "special magic numbers" needles under four
keys; the question asks for the numbers of all four keys at once.

The needles sit at seeded uniform depths (Sample.depth is None); the answers are listed in the order of the keys in
the question. Metric: string_match_all (the fraction of the four numbers found in the completion).

Differences from RULER: the haystack is the run's ("repeat", "corpus" or a user's file) rather than essays; keys
from this repo's word lists, joined "a, b, c and d"; 48 new tokens instead of 128.
"""

from __future__ import annotations

from eval.tasks import niah
from eval.tasks.base import Task

NAME = "niah_multiquery"
QUERIES = 4


def make_samples(tokenizer, length: int, samples: int, seed: int, *, haystack: str = "repeat", chat: bool = False):
    """niah_multiquery samples (see the module docstring)."""
    return niah.make_samples(NAME, tokenizer, length, samples, seed, haystack=haystack, chat=chat, kind="numbers",
                             queries=QUERIES)


TASKS = (Task(name=NAME, metric="string_match_all", max_new_tokens=48, make_samples=make_samples,
              doc="retrieve the numbers of four keys asked at once"),)
