"""Single needle (RULER's niah_single_1/2/3): one "special magic {kind}" needle in a haystack, asked back by its key.

Three tasks, one per value type: niah_single_number (a 7-digit number), niah_single_word (a noun from
`words.NOUNS`) and niah_single_uuid (a UUID). Sample i puts the needle at depth DEPTHS[i % 5] = 0.1, 0.3, 0.5,
0.7, 0.9 of the haystack (at the sentence boundary at or before it). Metric: string_match_all (the value
found in the completion).

Differences from RULER: the haystack (noise, essays) is chosen per run rather than per task variant (RULER pairs
single_1 with noise and single_2/3 with Paul Graham essays; here "repeat", "corpus" or a user's file for all
three); word values come from this repo's list instead of `wonderwords`; depths cycle over five fixed values
(RULER spreads them evenly over the samples); max_new_tokens is sized to the value (RULER generates 128).
"""

from __future__ import annotations

from eval.tasks import niah
from eval.tasks.base import Task


def _make(name: str, kind: str):
    def make_samples(tokenizer, length: int, samples: int, seed: int, *, haystack: str = "repeat",
                     chat: bool = False):
        return niah.make_samples(name, tokenizer, length, samples, seed, haystack=haystack, chat=chat, kind=kind)

    make_samples.__name__ = f"make_{name}"
    make_samples.__doc__ = f"{name} samples (see eval.tasks.niah_single)."
    return make_samples


TASKS = (
    Task(name="niah_single_number", metric="string_match_all", max_new_tokens=12,
         make_samples=_make("niah_single_number", "numbers"),
         doc="retrieve one 7-digit number hidden at a given depth, asked by its key"),
    Task(name="niah_single_word", metric="string_match_all", max_new_tokens=8,
         make_samples=_make("niah_single_word", "words"),
         doc="retrieve one word hidden at a given depth, asked by its key"),
    Task(name="niah_single_uuid", metric="string_match_all", max_new_tokens=40,
         make_samples=_make("niah_single_uuid", "uuids"),
         doc="retrieve one UUID (36 characters) hidden at a given depth, asked by its key"),
)
