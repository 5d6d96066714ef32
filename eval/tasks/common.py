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

import dataclasses
import os
import zlib
from typing import Callable, Sequence

import numpy as np

NOISE = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
HAYSTACKS = ("repeat", "corpus")
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)  # sample i of a needle task has depth DEPTHS[i % 5], as passkey's default
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
    from eval.passkey import special_prefix

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
