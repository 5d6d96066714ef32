"""Multi-key needle in a haystack (RULER's niah_multikey_1): four "special magic numbers" needles under four
different keys; the question asks for one key's number, the other three needles are distractors.

Sample i puts the queried needle at depth DEPTHS[i % 5] = 0.1, 0.3, 0.5, 0.7, 0.9 of the haystack and the three
distractors at seeded uniform depths; distractor keys and values differ from the queried ones. Metric:
string_match_all (the queried number found in the completion; naming a distractor as well is not penalised, as
in RULER).

Differences from RULER: the haystack is the run's ("repeat", "corpus" or a user's file), not always essays; only
the distractor-needle variant (RULER's multikey_2/3, whose haystack is made of needles, are not generated); keys
from this repo's word lists; depths cycle over five fixed values; 12 new tokens instead of 128.
"""

from __future__ import annotations

from eval.tasks import niah
from eval.tasks.base import Task

NAME = "niah_multikey"
DISTRACTORS = 3


def make_samples(tokenizer, length: int, samples: int, seed: int, *, haystack: str = "repeat", chat: bool = False):
    """niah_multikey samples (see the module docstring)."""
    return niah.make_samples(NAME, tokenizer, length, samples, seed, haystack=haystack, chat=chat, kind="numbers",
                             distractors=DISTRACTORS)


TASKS = (Task(name=NAME, metric="string_match_all", max_new_tokens=12, make_samples=make_samples,
              doc="retrieve the number of one key among four keyed needles (three distractors)"),)
