"""Frequent-word extraction (RULER's fwe): a long run of "coded" words with Zipf-distributed frequencies; the
question asks for the three most frequent.

    HEAD    "Read the following coded text and track the frequency of each coded word. Find the three most
             frequently appeared coded words."
    text    " {word} {word} ..." in a seeded order
    TAIL    "Question: What are the three most frequently appeared words in the above coded text?"
    ANSWER  "Answer: According to the coded text above, the three most frequently appeared words are:"

Frequencies are Zipf's with exponent ALPHA = 2 (RULER's), made deterministic: with about N words, the word of rank
r appears floor(N / (2 r^2)) times while that is at least 2, then words of count 1 fill the text to the exact
length, so the three answers are strictly the most frequent. Words: seeded random strings of 3-6 lowercase letters
for the "repeat" haystack (RULER's coded words); the words of the corpus for "corpus" or a user's file (the
haystack here is only the word source). Metric: string_match_all (the fraction of the three found in the
completion).

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
_EST_WORD = 4  # tokens per word, for the frequencies only


def coded_word(rng: np.random.Generator) -> str:
    return "".join(rng.choice(list(string.ascii_lowercase), size=int(rng.integers(3, 7))))


def make_samples(tokenizer, length: int, samples: int, seed: int, *, haystack: str = "repeat", chat: bool = False):
    """fwe samples (see the module docstring); answers: the three most frequent words, most frequent first."""
    common.check_request(NAME, length, samples)
    haystack = common.check_haystack(haystack)
    pool = None if haystack == "repeat" else common.corpus_words(tokenizer, haystack)
    prefix, suffix = common.frame(tokenizer, HEAD, TAIL, ANSWER, chat)
    budget = length - len(prefix) - len(suffix)
    template = common.decode(tokenizer, prefix + suffix)
    n_est = budget // _EST_WORD
    freqs = []
    r = 1
    while (c := int(n_est / (2 * r ** ALPHA))) >= 2:
        freqs.append(c)
        r += 1
    if len(freqs) < TOP + 1 or freqs[TOP - 1] <= freqs[TOP]:
        raise ValueError(f"task {NAME!r}: length={length} is too short to rank {TOP} words by frequency; expected a "
                         f"length >= {length - budget + 64 * _EST_WORD}")
    out = []
    for i in range(samples):
        rng = common.sample_rng(NAME, seed, length, i)
        words = common.WordSource(tokenizer, rng, avoid=template, pool=pool,
                                  make=None if pool is not None else coded_word)
        counts: dict[str, int] = {}
        used = 0
        for c in freqs:
            w = words.take()
            if w is None or used + c * words.cost(w) > budget - 16:
                if len(counts) <= TOP:
                    raise ValueError(f"task {NAME!r}: length={length} is too short to rank {TOP} words by frequency")
                break
            counts[w] = c
            used += c * words.cost(w)
        answers = tuple(list(counts)[:TOP])
        gap = common.fill_list(budget, counts, words, lambda j: 0)
        items = [w for w, c in counts.items() for _ in range(c)]
        pieces = common.word_ids(tokenizer, counts)
        body: list[int] = []
        for k in rng.permutation(len(items)):
            body += pieces[items[k]]
        tokens = prefix + body + suffix
        assert len(tokens) == length - gap, (len(tokens), length, gap)
        if gap > 0.01 * length:
            raise RuntimeError(f"task {NAME!r}: could not fill length={length} within 1% ({gap} tokens short)")
        out.append(Sample(task=NAME, tokens=tuple(tokens), answers=answers, depth=None, length=length))
    return out


TASKS = (Task(name=NAME, metric="string_match_all", max_new_tokens=24, make_samples=make_samples,
              doc="name the three most frequent words of a long Zipf-distributed coded text"),)
