"""Common-word extraction (RULER's cwe): a numbered list of words in which ten words recur much more often than
the rest; the question asks for the ten most common.

    HEAD    "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones
             that appear most often."
    list    "1. {word}\\n2. {word}\\n..." in a seeded order
    TAIL    "Question: What are the 10 most common words in the above list?"
    ANSWER  "Answer: The top 10 words that appear most often in the list are:"

Frequencies scale with the length (RULER fixes 30 and 3 and grows the vocabulary instead): with about N items,
each common word appears max(3, N // 20) times (about half the list), the other words `uncommon` times (1 at
short lengths, more when the word pool runs short) or once (the words that fill the list to the exact length), so
the ten answers are always strictly the most frequent. Words: this repo's list (`words.NOUNS + ADJECTIVES`) for the
"repeat" haystack; the words of the corpus for "corpus" or a user's file (the haystack here is only the word
source: the list is the whole context). Metric: string_match_all (the fraction of the ten found in the
completion).

When the words cannot close the last few tokens exactly (rare: the pool nearly used up), blank lines before the
question do, so the length is exact.

Differences from RULER: no one-shot example before the list; frequencies scale with the length as above; one item
per line; 48 new tokens instead of 120.
"""

from __future__ import annotations

import functools
import math

from eval.tasks import common
from eval.tasks.base import Sample, Task
from eval.tasks.words import ADJECTIVES, NOUNS

NAME = "cwe"
COMMON = 10
HEAD = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones "
        "that appear most often.\n")
TAIL = "Question: What are the {k} most common words in the above list?"
ANSWER = " Answer: The top {k} words that appear most often in the list are:"
_EST_ITEM = 5  # tokens per item, for the frequencies only


def make_samples(tokenizer, length: int, samples: int, seed: int, *, haystack: str = "repeat", chat: bool = False):
    """cwe samples (see the module docstring); answers: the ten common words."""
    common.check_request(NAME, length, samples)
    haystack = common.check_haystack(haystack)
    pool = NOUNS + ADJECTIVES if haystack == "repeat" else common.corpus_words(tokenizer, haystack)
    prefix, suffix = common.frame(tokenizer, HEAD, TAIL.format(k=COMMON), ANSWER.format(k=COMMON), chat)
    newline = common.ids(tokenizer, "\n")
    index_ids = functools.lru_cache(maxsize=None)(lambda i: tuple(common.ids(tokenizer, f"{i}.")))
    index_cost = lambda i: len(index_ids(i)) + len(newline)  # noqa: E731
    budget = length - len(prefix) - len(suffix)
    template = common.decode(tokenizer, prefix + suffix)
    items = max(budget // _EST_ITEM, 1)
    freq = max(3, items // 20)
    out = []
    for i in range(samples):
        rng = common.sample_rng(NAME, seed, length, i)
        words = common.WordSource(tokenizer, rng, avoid=template, pool=pool)
        counts = {words.take(): freq for _ in range(COMMON)}
        if None in counts:
            raise ValueError(f"task {NAME!r}: the word pool ({len(pool)} words) has fewer than {COMMON} usable words; "
                             "use a haystack file with more distinct words")
        answers = tuple(counts)
        used = sum(freq * words.cost(w) for w in counts) + sum(index_cost(j) for j in range(1, COMMON * freq + 1))
        if used + 8 * (index_cost(COMMON * freq + 8) + 4) > budget:
            raise ValueError(f"task {NAME!r}: length={length} is too short for {COMMON} words {freq} times each; "
                             f"expected a length >= {length - budget + used + 8 * (index_cost(COMMON * freq) + 4)}")
        uncommon = max(1, math.ceil((items - COMMON * freq) / max(len(pool) - COMMON - 16, 1)))
        if uncommon >= freq:
            raise ValueError(f"task {NAME!r}: length={length} needs more distinct words than the {len(pool)} of the "
                             "word pool; use a corpus haystack (more words) or a shorter length")
        n = COMMON * freq
        reserve = 8 * (index_cost(n) + 4)  # room left for the words of count 1 that fill the list exactly
        while True:
            w = words.take()
            if w is None:
                break
            extra = uncommon * words.cost(w) + sum(index_cost(j) for j in range(n + 1, n + uncommon + 1))
            if used + extra > budget - reserve:
                words.give_back(w)
                break
            counts[w] = uncommon
            used, n = used + extra, n + uncommon
        gap = common.fill_list(budget, counts, words, index_cost)
        items_list = [w for w, c in counts.items() for _ in range(c)]
        order = rng.permutation(len(items_list))
        pieces = common.word_ids(tokenizer, counts)
        body: list[int] = []
        for j, k in enumerate(order, start=1):
            body += list(index_ids(j)) + pieces[items_list[k]] + newline
        tokens = common.close_word_list(tokenizer, NAME, prefix, body, suffix, gap, length, len(words.taken),
                                        "use a haystack with more distinct words "
                                        "(a corpus holds more words than the 'repeat' list)")
        out.append(Sample(task=NAME, tokens=tokens, answers=answers, depth=None, length=length))
    return out


TASKS = (Task(name=NAME, metric="string_match_all", max_new_tokens=48, make_samples=make_samples,
              doc="name the ten words that recur most often in a long numbered list"),)
