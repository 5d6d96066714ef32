"""Machinery shared by the generated tasks: haystacks, the chat template, and prompt assembly in token space.

A prompt is assembled from token-id pieces, so its length is exact:

    raw:   [special prefix] HEAD  FILLER with needles inserted  TAIL  ANSWER_PREFIX
    chat:  [template up to the user's text] HEAD  FILLER ...  TAIL  [template from the user's text to the
           assistant's turn] ANSWER_PREFIX

The template pieces come from rendering the tokenizer's chat template around a sentinel user message and
splitting at the sentinel, so the filler budget is known before the filler is drawn.

Haystacks (`haystack`):
  "repeat"  RULER's noise: "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back
            again." repeated in this order; needles go between sentences.
  "corpus"  the shipped default corpus (`eval.ppl.DEFAULT_CORPUS`, The Call of the Wild, see eval/data/README.md)
  a path    a UTF-8 text file of the user's.
For a corpus the filler is a stretch of its tokens from the start of a seeded sentence, and a needle goes after
the last token that ends a sentence (., !, ? or a paragraph break) at or before its requested depth.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import zlib
from typing import Callable, Sequence

import numpy as np

from eval.passkey import DEFAULT_DEPTHS, special_prefix

NOISE = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
HAYSTACKS = ("repeat", "corpus")
DEPTHS = DEFAULT_DEPTHS  # sample i of a needle task has depth DEPTHS[i % 5] = 0.1, 0.3, ..., 0.9, as passkey
_SENTINEL = "\u2063JSPARSE_USER_TEXT\u2063"
_MAX_TRIES = 50

# Per-tokenizer caches (tokenizers are not hashable): id(tokenizer) -> (tokenizer, {key: value}).
_CACHE: dict[int, tuple[object, dict]] = {}


def _cached(tokenizer, key, build: Callable):
    entry = _CACHE.get(id(tokenizer))
    if entry is None or entry[0] is not tokenizer:
        entry = (tokenizer, {})
        _CACHE[id(tokenizer)] = entry
    store = entry[1]
    if key not in store:
        store[key] = build()
    return store[key]


def ids(tokenizer, text: str) -> list[int]:
    """Token ids of `text`, no special tokens added."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def decode(tokenizer, tokens: Sequence[int]) -> str:
    return tokenizer.decode(list(tokens), skip_special_tokens=False)


def check_request(task: str, length, samples) -> None:
    """Raises ValueError naming a length or sample count that is not a positive int."""
    if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < 1:
        raise ValueError(f"task {task!r}: length={length!r}, expected a positive number of tokens")
    if isinstance(samples, bool) or not isinstance(samples, (int, np.integer)) or samples < 1:
        raise ValueError(f"task {task!r}: samples={samples!r}, expected >= 1")


def sample_rng(task: str, seed: int, length: int, i: int) -> np.random.Generator:
    """The generator of sample i: depends only on (task, seed, length, i), so every method sees the same prompts
    and two tasks with one seed draw different values."""
    return np.random.default_rng([zlib.crc32(task.encode()), int(seed), int(length), int(i)])


# ----------------------------------------------------------------------------------------------------------- chat

def chat_pieces(tokenizer) -> tuple[list[int], list[int]]:
    """(before, after): the chat template's token ids before and after the user's text of a one-message
    conversation, the assistant's turn opened (add_generation_prompt).

    Raises:
      ValueError: the tokenizer has no chat template.
    """
    def build():
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"chat=True: the tokenizer {type(tokenizer).__name__} "
                             f"({getattr(tokenizer, 'name_or_path', '?')!r}) has no chat template; use chat=False "
                             "(raw completion)")
        text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False,
                                             add_generation_prompt=True)
        if text.count(_SENTINEL) != 1:
            raise ValueError("the tokenizer's chat template does not place the user's text once verbatim; "
                             "use chat=False (raw completion)")
        before, after = text.split(_SENTINEL)
        return ids(tokenizer, before), ids(tokenizer, after)

    return _cached(tokenizer, "chat", build)


def frame(tokenizer, head: str, tail: str, answer_prefix: str, chat: bool) -> tuple[list[int], list[int]]:
    """(prefix, suffix) token ids around the filler: raw = special prefix + head / tail + answer prefix; chat =
    template + head / tail + template + answer prefix (the answer prefix opens the assistant's turn)."""
    if chat:
        before, after = chat_pieces(tokenizer)
        return before + ids(tokenizer, head), ids(tokenizer, tail) + after + ids(tokenizer, answer_prefix.lstrip())
    return special_prefix(tokenizer) + ids(tokenizer, head), ids(tokenizer, tail + answer_prefix)


# ------------------------------------------------------------------------------------------------------ haystacks

def check_haystack(haystack: str) -> str:
    """Returns "repeat", "corpus" or the path; raises ValueError naming a value that is neither a known haystack
    nor an existing file."""
    if not isinstance(haystack, (str, os.PathLike)):
        raise ValueError(f"haystack={haystack!r}: expected one of {list(HAYSTACKS)} or a path to a UTF-8 text file")
    haystack = os.fspath(haystack)
    if haystack in HAYSTACKS:
        return haystack
    if not os.path.isfile(haystack):
        raise ValueError(f"haystack={haystack!r}: expected one of {list(HAYSTACKS)} or a path to an existing UTF-8 "
                         "text file")
    return haystack


def corpus_path(haystack: str) -> str:
    from eval.ppl import DEFAULT_CORPUS

    return DEFAULT_CORPUS if haystack == "corpus" else haystack


def corpus_text(haystack: str) -> str:
    from eval.ppl import read_corpus

    return read_corpus(corpus_path(haystack))


@dataclasses.dataclass(frozen=True)
class CorpusTokens:
    """A tokenized corpus: ids i32[N] and ends bool[N] (token i ends a sentence: its text ends with . ! ? (closing
    quotes and whitespace ignored) or holds a paragraph break; a single newline is a line wrap, not an end)."""

    ids: np.ndarray
    ends: np.ndarray


def corpus_tokens(tokenizer, haystack: str) -> CorpusTokens:
    """The corpus of a "corpus" or path haystack, tokenized once per tokenizer and file."""
    path = os.path.abspath(corpus_path(haystack))

    def build():
        from eval.ppl import tokenize_corpus

        tokens = tokenize_corpus(tokenizer, corpus_text(haystack))
        uniq = np.unique(tokens)
        ending = set()
        for t in uniq:
            s = tokenizer.decode([int(t)])
            if "\n\n" in s or s.rstrip().rstrip("\"'\u201d\u2019)").endswith((".", "!", "?")):
                ending.add(int(t))
        ends = np.isin(tokens, np.fromiter(ending, np.int64, len(ending)))
        return CorpusTokens(ids=tokens, ends=ends)

    return _cached(tokenizer, ("corpus", path, os.path.getmtime(path)), build)


def filler(tokenizer, haystack: str, n: int, rng: np.random.Generator) -> tuple[list[int], list[int]]:
    """(tokens, boundaries): n filler tokens of the haystack and the positions (0..n, ascending, 0 included)
    where a needle may go (after a sentence's last token).

    Raises:
      ValueError: the corpus has fewer than n tokens (naming both numbers).
    """
    haystack = check_haystack(haystack)
    if haystack == "repeat":
        sentences = _cached(tokenizer, "noise", lambda: [ids(tokenizer, " " + s) for s in NOISE])
        tokens: list[int] = []
        bounds = [0]
        k = 0
        while len(tokens) < n:
            tokens += sentences[k % len(sentences)]
            bounds.append(len(tokens))
            k += 1
        return tokens[:n], [b for b in bounds if b <= n]
    corpus = corpus_tokens(tokenizer, haystack)
    N = len(corpus.ids)
    if N < n:
        raise ValueError(f"haystack {corpus_path(haystack)!r} has {N} tokens, fewer than the {n} filler tokens this "
                         "prompt needs; give a longer text file or a shorter length")
    starts = np.flatnonzero(corpus.ends[:N - n]) + 1  # the filler starts at a sentence's start when it can
    start = int(starts[rng.integers(len(starts))]) if len(starts) else int(rng.integers(0, N - n + 1))
    tokens = [int(t) for t in corpus.ids[start:start + n]]
    bounds = [0] + [int(i) + 1 for i in np.flatnonzero(corpus.ends[start:start + n])]
    return tokens, sorted(set(bounds))


def assemble(tokenizer, task: str, length: int, prefix: list[int], suffix: list[int],
             needles: Sequence[tuple[list[int], float]], haystack: str, rng: np.random.Generator,
             min_filler: int = 16) -> list[int]:
    """A prompt of exactly `length` tokens: prefix + filler with the needles inserted + suffix.

    Args:
      needles: (token ids, depth) pairs; a needle goes at the last sentence boundary of the filler at or before
        depth * F (F: the filler tokens); needles sharing a boundary keep their order.
    Raises:
      ValueError: the length leaves fewer than `min_filler` filler tokens (naming the length and the minimum).
    """
    fixed = len(prefix) + len(suffix) + sum(len(t) for t, _ in needles)
    n = length - fixed
    if n < min_filler:
        raise ValueError(f"task {task!r}: length={length} is too short: the instructions, question and needles take "
                         f"{fixed} tokens with this tokenizer; expected a length >= {fixed + min_filler}")
    tokens, bounds = filler(tokenizer, haystack, n, rng)
    bounds_arr = np.asarray(bounds)
    cuts = []
    for j, (_, depth) in enumerate(needles):
        target = int(round(float(depth) * n))
        cuts.append((int(bounds_arr[np.searchsorted(bounds_arr, target, side="right") - 1]), j))
    out = list(prefix)
    pos = 0
    for cut, j in sorted(cuts):
        out += tokens[pos:cut] + list(needles[j][0])
        pos = cut
    out += tokens[pos:] + list(suffix)
    assert len(out) == length, (len(out), length)
    return out


def count(text: str, value: str) -> int:
    """Occurrences of value in text (case-insensitive, overlapping ones too)."""
    text, value = text.lower(), value.lower()
    c, i = 0, text.find(value)
    while i >= 0:
        c += 1
        i = text.find(value, i + 1)
    return c


def retry(task: str, build: Callable[[], tuple[list[int], dict[str, int], object]], tokenizer):
    """Calls build() -> (tokens, {string: expected occurrences}, answers) until every string occurs in the decoded
    prompt exactly as expected (a value drawn from the rng may also occur in a corpus haystack, or inside a
    word of the template); returns (tokens, answers) of the first good draw."""
    for _ in range(_MAX_TRIES):
        tokens, expected, answers = build()
        text = decode(tokenizer, tokens)
        if all(count(text, s) == c for s, c in expected.items()):
            return tokens, answers
    raise RuntimeError(f"task {task!r}: {_MAX_TRIES} draws all put a value where it does not belong "
                       f"(last: {expected})")  # pragma: no cover - a haystack full of the word lists


# --------------------------------------------------------------------------------------------------------- values

def number(rng: np.random.Generator) -> str:
    """A 7-digit number (RULER's numbers)."""
    return str(int(rng.integers(1_000_000, 10_000_000)))


def uuid(rng: np.random.Generator) -> str:
    """A version-4 UUID from the rng's bytes."""
    import uuid as _uuid

    return str(_uuid.UUID(bytes=rng.bytes(16), version=4))


def distinct(rng: np.random.Generator, draw: Callable[[np.random.Generator], str], k: int,
             avoid: Sequence[str] = ()) -> list[str]:
    """k distinct values of draw(rng), none equal to (or containing, or contained in) another or one of `avoid`."""
    out: list[str] = []
    seen = [a.lower() for a in avoid]
    while len(out) < k:
        v = draw(rng)
        lv = v.lower()
        if any(lv in s or s in lv for s in seen):
            continue
        out.append(v)
        seen.append(lv)
    return out


# ---------------------------------------------------------------------------------------------------- word lists

def corpus_words(tokenizer, haystack: str) -> tuple[str, ...]:
    """The distinct lowercase words (4-12 letters a-z) of a corpus or path haystack, sorted."""
    import re

    path = os.path.abspath(corpus_path(haystack))
    return _cached(tokenizer, ("words", path, os.path.getmtime(path)),
                   lambda: tuple(sorted(set(re.findall(r"\b[a-z]{4,12}\b", corpus_text(haystack).lower())))))


class WordSource:
    """Distinct words for a list task, drawn with the sample's rng: from `pool` when given, else made by
    `make(rng)`. No word taken is inside another one taken or inside `avoid` (the prompt's own text), so a
    substring match scores only its own word.

    cost(w): the tokens of " " + w; take(cost=None): an unused word (of exactly `cost` tokens when given), or None
    when there is none left (pool) or none found in 2048 draws (make).
    """

    def __init__(self, tokenizer, rng: np.random.Generator, pool: Sequence[str] | None = None,
                 make: Callable[[np.random.Generator], str] | None = None, avoid: str = ""):
        self.tokenizer, self.rng, self.make, self.avoid = tokenizer, rng, make, avoid.lower()
        self.taken: list[str] = []
        self._taken: set[str] = set()
        self._subs: collections.Counter = collections.Counter()  # every substring of the words taken
        self._costs: dict[str, int] = {}
        self._dropped: set[str] = set()
        self._made: list[str] = []  # words made (with their costs) and not yet taken
        if pool is not None:
            pool = tuple(pool)
            self._costs.update(_cached(tokenizer, ("costs", pool), lambda: dict(zip(pool, map(len, tokenizer(
                [" " + w for w in pool], add_special_tokens=False)["input_ids"])))))
            order = [pool[j] for j in rng.permutation(len(pool))]
            self._free = order[::-1]  # popped from the end: the seeded order
            self._by_cost: dict[int, list[str]] = collections.defaultdict(list)
            for w in self._free:
                self._by_cost[self._costs[w]].append(w)

    def cost(self, word: str) -> int:
        if word not in self._costs:
            self._costs[word] = len(ids(self.tokenizer, " " + word))
        return self._costs[word]

    @staticmethod
    def _substrings(word: str):
        return {word[a:b] for a in range(len(word)) for b in range(a + 1, len(word) + 1)}

    def _ok(self, word: str) -> bool:
        if word in self.avoid or self._subs[word] > 0:
            return False
        return not any(s in self._taken for s in self._substrings(word))

    def _add(self, word: str) -> str:
        self.taken.append(word)
        self._taken.add(word)
        self._subs.update(self._substrings(word))
        return word

    def take(self, cost: int | None = None) -> str | None:
        if self.make is None:
            free = self._free if cost is None else self._by_cost.get(cost, [])
            while free:
                w = free.pop()
                if w in self._dropped or w in self._taken:
                    continue  # taken through the other list, or dropped
                if self._ok(w):
                    return self._add(w)
                self._dropped.add(w)  # clashes with a word taken: never offered again
            return None
        batches = 0  # the words made so far are looked at first, then up to 32 more batches of 64
        while True:
            j = next((j for j, w in enumerate(self._made) if cost is None or self._costs[w] == cost), None)
            if j is None:
                if batches == 32:
                    return None
                made = [self.make(self.rng) for _ in range(64)]
                enc = self.tokenizer([" " + w for w in made], add_special_tokens=False)["input_ids"]
                self._costs.update({w: len(e) for w, e in zip(made, enc)})
                self._made += made
                batches += 1
                continue
            w = self._made.pop(j)
            if w not in self._taken and self._ok(w):
                return self._add(w)

    def give_back(self, word: str) -> None:
        self.taken.remove(word)
        self._taken.discard(word)
        self._subs.subtract(self._substrings(word))
        if self.make is None:
            self._free.append(word)
            self._by_cost[self.cost(word)].append(word)


def word_ids(tokenizer, words) -> dict[str, list[int]]:
    """{word: ids of " " + word} for distinct words, tokenized in one batch."""
    words = list(dict.fromkeys(words))
    return dict(zip(words, tokenizer([" " + w for w in words], add_special_tokens=False)["input_ids"]))


def fill_list(budget: int, counts: dict[str, int], words: WordSource, index_cost: Callable[[int], int],
              max_cost: int = 6) -> int:
    """Adds words of count 1 to `counts` (in place) until the list costs `budget` tokens; returns the tokens left
    unfilled (0 unless no word of a fitting length is left).

    The list of n items costs sum(count * words.cost(w)) + sum(index_cost(i) for i in 1..n) tokens (index_cost:
    the item's own tokens besides its word, e.g. "12." and a newline). Words are added while they fit; the last
    gap is closed by an item of exactly the right length or by swapping count-1 words for longer ones.
    """
    n = sum(counts.values())
    total = sum(c * words.cost(w) for w, c in counts.items()) + sum(index_cost(i) for i in range(1, n + 1))
    if total > budget:
        raise ValueError(f"list of {total} tokens over a budget of {budget}")  # pragma: no cover - callers check
    while True:
        gap, ic = budget - total, index_cost(n + 1)
        if gap == 0:
            return 0
        if 1 <= gap - ic <= max_cost:
            w = words.take(gap - ic)
            if w is not None:
                counts[w] = 1
                return 0
        w = words.take()
        if w is None:
            break
        new_total = total + ic + words.cost(w)
        if new_total != budget and new_total > budget - 1 - index_cost(n + 2):  # leave room for one more item
            words.give_back(w)
            break
        counts[w] = 1
        n, total = n + 1, new_total
    gap = budget - total
    singles = [w for w, c in counts.items() if c == 1]
    while gap > 0:
        for d in range(min(gap, max_cost), 0, -1):
            for length in sorted({words.cost(s) for s in singles}):
                w = words.take(length + d)
                if w is not None:
                    s = next(s for s in singles if words.cost(s) == length)
                    del counts[s]
                    words.give_back(s)
                    counts[w] = 1
                    singles[singles.index(s)] = w
                    gap -= d
                    break
            else:
                continue
            break
        else:
            return gap
    return 0


def close_word_list(tokenizer, task: str, prefix: list[int], body: list[int], suffix: list[int], gap: int,
                    length: int, words_taken: int, hint: str) -> tuple[int, ...]:
    """The prompt of a word-list task (cwe, fwe): prefix + body + suffix, exactly `length` tokens.

    A gap of more than 1% of the length means the word source ran dry: a ValueError naming the length and `hint`
    (what to change). A smaller gap the words could not close becomes blank lines before the question.
    """
    if gap > 0.01 * length:
        raise ValueError(f"task {task!r}: length={length}: the word source ran out of distinct words after "
                         f"{words_taken} ({gap} tokens short); {hint} or a shorter length")
    tokens = prefix + body + ids(tokenizer, "\n")[-1:] * gap + suffix
    assert len(tokens) == length, (len(tokens), length, gap)
    return tuple(tokens)

