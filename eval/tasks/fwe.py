"""Frequent-word extraction (RULER's fwe): a long run of "coded" words with Zipf-distributed frequencies; the
question asks for the three most frequent.

    HEAD    "Read the following coded text and track the frequency of each coded word. Find the three most
             frequently appeared coded words."
    text    " {word} {word} ..." in a seeded order
    TAIL    "Question: What are the three most frequently appeared words in the above coded text?"
    ANSWER  "Answer: According to the coded text above, the three most frequently appeared words are:"

Frequencies are Zipf's with exponent ALPHA = 2 (RULER's), made deterministic: the word of rank r appears
floor(S / r^2) times while that is at least 2, S set so that these ranked words take RANKED_SHARE = 85% of the
text's tokens; words of count 1 fill the rest to the exact length, so the three answers are strictly the most
frequent. Words: seeded random strings of 3-6 lowercase letters
for the "repeat" haystack (RULER's coded words); the words of the corpus for "corpus" or a user's file (the
haystack here is only the word source). Metric: string_match_all (the fraction of the three found in the
completion).

When the words cannot close the last few tokens exactly, blank lines before the question do, so the length is
exact. A corpus's words serve up to about 30K tokens of The Call of the Wild; past that the error says so.

Differences from RULER: no "...." noise word (RULER makes it the most frequent "word" and asks to ignore it);
frequencies are exact rather than sampled; 24 new tokens instead of 50.
"""

from __future__ import annotations

import string

import numpy as np

from eval.tasks import common
from eval.tasks.base import Sample, Task

NAME = "fwe"
TOP = 3
ALPHA = 2.0
HEAD = ("Read the following coded text and track the frequency of each coded word. Find the three most frequently "
        "appeared coded words.\n")
TAIL = "\nQuestion: What are the three most frequently appeared words in the above coded text?"
ANSWER = " Answer: According to the coded text above, the three most frequently appeared words are:"
RANKED_SHARE = 0.85  # of the text's tokens: the ranked words; the rest are words of count 1


def coded_word(rng: np.random.Generator) -> str:
    return "".join(rng.choice(list(string.ascii_lowercase), size=int(rng.integers(3, 7))))


def _ranked_counts(words: common.WordSource, budget: int) -> dict[str, int] | None:
    """{word: count} of the ranked words, most frequent first: count_r = floor(S / r^ALPHA) >= 2, with S set so that
    they take RANKED_SHARE of `budget` tokens (by the words' own token costs); None when fewer than TOP + 1 ranks
    fit or rank TOP is not strictly above rank TOP + 1."""
    ranked: list[str] = []
    weight = 0.0  # sum over the ranks of cost_r / r^ALPHA
    while True:
        w = words.take()
        if w is None:
            break
        r = len(ranked) + 1
        if RANKED_SHARE * budget / (weight + words.cost(w) / r ** ALPHA) / r ** ALPHA < 2:
            words.give_back(w)
            break
        ranked.append(w)
        weight += words.cost(w) / r ** ALPHA
    if len(ranked) <= TOP:
        return None
    scale = RANKED_SHARE * budget / weight
    counts = {w: int(scale / r ** ALPHA) for r, w in enumerate(ranked, start=1)}
    if counts[ranked[TOP - 1]] <= counts[ranked[TOP]]:
        return None
    return counts


def make_samples(tokenizer, length: int, samples: int, seed: int, *, haystack: str = "repeat", chat: bool = False):
    """fwe samples (see the module docstring); answers: the three most frequent words, most frequent first."""
    common.check_request(NAME, length, samples)
    haystack = common.check_haystack(haystack)
    pool = None if haystack == "repeat" else common.corpus_words(tokenizer, haystack)
    prefix, suffix = common.frame(tokenizer, HEAD, TAIL, ANSWER, chat)
    budget = length - len(prefix) - len(suffix)
    template = common.decode(tokenizer, prefix + suffix)
    out = []
    for i in range(samples):
        rng = common.sample_rng(NAME, seed, length, i)
        words = common.WordSource(tokenizer, rng, avoid=template, pool=pool,
                                  make=None if pool is not None else coded_word)
        counts = _ranked_counts(words, budget)
        if counts is None:
            raise ValueError(f"task {NAME!r}: length={length} is too short to rank {TOP} words by frequency; expected "
                             f"a length >= {length - budget + 256}")
        answers = tuple(list(counts)[:TOP])
        gap = common.fill_list(budget, counts, words, lambda j: 0)
        items = [w for w, c in counts.items() for _ in range(c)]
        pieces = common.word_ids(tokenizer, counts)
        body: list[int] = []
        for k in rng.permutation(len(items)):
            body += pieces[items[k]]
        tokens = common.close_word_list(tokenizer, NAME, prefix, body, suffix, gap, length, len(words.taken),
                                        "use a haystack with more distinct words "
                                        "(the 'repeat' haystack makes coded words without limit)")
        out.append(Sample(task=NAME, tokens=tokens, answers=answers, depth=None, length=length))
    return out


TASKS = (Task(name=NAME, metric="string_match_all", max_new_tokens=24, make_samples=make_samples,
              doc="name the three most frequent words of a long Zipf-distributed coded text"),)
