"""The needle-in-a-haystack family's shared generator (RULER's `niah` template), used by niah_single,
niah_multikey, niah_multivalue and niah_multiquery.

    HEAD    "Some special magic {kind} are hidden within the following text. Make sure to memorize it. I will
             quiz you about the {kind} afterwards."
    NEEDLE  "One of the special magic {kind} for {key} is: {value}."      (inserted between haystack sentences)
    TAIL    "What are all the special magic {kind} for {query} mentioned in the provided text?"
    ANSWER  "The special magic {kind} for {query} mentioned in the provided text are"   (the answer prefix)

kind: "numbers" (7-digit), "words" (`words.NOUNS`) or "uuids"; keys are "{adjective}-{noun}" from `words`.
Every value occurs in the prompt exactly once (a draw that a corpus haystack happens to contain is redrawn), every
key in its needle(s) and, when queried, in the question and the answer prefix; distractor keys and values differ
from (and do not contain) the queried ones.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from eval.tasks import common
from eval.tasks.base import Sample
from eval.tasks.words import ADJECTIVES, NOUNS

HEAD = ("Some special magic {kind} are hidden within the following text. Make sure to memorize it. I will quiz "
        "you about the {kind} afterwards.\n")
NEEDLE = " One of the special magic {kind} for {key} is: {value}."
TAIL = "\nWhat are all the special magic {kind} for {query} mentioned in the provided text?"
ANSWER = " The special magic {kind} for {query} mentioned in the provided text are"

KINDS = ("numbers", "words", "uuids")


def key(rng: np.random.Generator) -> str:
    return f"{ADJECTIVES[int(rng.integers(len(ADJECTIVES)))]}-{NOUNS[int(rng.integers(len(NOUNS)))]}"


def word(rng: np.random.Generator) -> str:
    return NOUNS[int(rng.integers(len(NOUNS)))]


VALUES: dict[str, Callable[[np.random.Generator], str]] = {"numbers": common.number, "words": word,
                                                            "uuids": common.uuid}


def query_text(keys: list[str]) -> str:
    """"a", "a and b", "a, b and c" (RULER joins with ", " and ", and ")."""
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + " and " + keys[-1]


def make_samples(task: str, tokenizer, length: int, samples: int, seed: int, *, haystack: str, chat: bool,
                 kind: str, queries: int = 1, values_per_key: int = 1, distractors: int = 0) -> list[Sample]:
    """Samples of a niah task.

    Args:
      kind: one of KINDS (the values' type).
      queries: keys asked for (multi-query: 4); values_per_key: needles per queried key (multi-value: 4);
        distractors: needles of other keys (multi-key: 3).
    Depth: with one needle to find (queries = values_per_key = 1) sample i puts it at common.DEPTHS[i % 5] and
    the distractors at seeded uniform depths (Sample.depth is the requested depth); otherwise every needle is at
    a seeded uniform depth (Sample.depth None).
    """
    common.check_request(task, length, samples)
    haystack = common.check_haystack(haystack)
    draw = VALUES[kind]
    single = queries == 1 and values_per_key == 1
    out = []
    for i in range(samples):
        rng = common.sample_rng(task, seed, length, i)
        depth = common.DEPTHS[i % len(common.DEPTHS)] if single else None

        def build():
            keys = common.distinct(rng, key, queries + distractors)
            n_values = queries * values_per_key + distractors
            values = common.distinct(rng, draw, n_values, avoid=keys)
            asked = keys[:queries]
            needles = []  # (key, value, queried)
            for q, k in enumerate(asked):
                for v in range(values_per_key):
                    needles.append((k, values[q * values_per_key + v], True))
            for d in range(distractors):
                needles.append((keys[queries + d], values[queries * values_per_key + d], False))
            depths = list(rng.uniform(0.0, 1.0, size=len(needles)))
            if single:
                depths[0] = depth
            order = rng.permutation(len(needles))  # shuffled, so needle order says nothing about the query
            needles = [needles[j] for j in order]
            depths = [depths[j] for j in order]
            query = query_text(asked)
            prefix, suffix = common.frame(tokenizer, HEAD.format(kind=kind), TAIL.format(kind=kind, query=query),
                                          ANSWER.format(kind=kind, query=query), chat)
            pieces = [(common.ids(tokenizer, NEEDLE.format(kind=kind, key=k, value=v)), d)
                      for (k, v, _), d in zip(needles, depths)]
            tokens = common.assemble(tokenizer, task, length, prefix, suffix, pieces, haystack, rng)
            expected = {v: 1 for _, v, _ in needles}
            for k in keys:
                expected[k] = sum(nk == k for nk, _, _ in needles) + (2 if k in asked else 0)
            return tokens, expected, tuple(values[:queries * values_per_key])  # in the order of the keys asked

        tokens, answers = common.retry(task, build, tokenizer)
        out.append(Sample(task=task, tokens=tuple(tokens), answers=answers, depth=depth, length=length))
    return out
