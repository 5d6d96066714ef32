"""Passkey retrieval: a 5-digit key hidden at a chosen depth in seeded filler text, asked back at the end.

The prompt is a raw completion (no chat template), assembled in token space so that it has exactly the
requested number of tokens:

    [special prefix (BOS, if the tokenizer adds one)] INTRO  FILLER[:before]  NEEDLE  FILLER[before:] \n QUESTION

  INTRO    "There is an important piece of information hidden inside a lot of irrelevant text. ..."
  NEEDLE   "The pass key is 71432. Remember it. 71432 is the pass key."
  QUESTION "What is the pass key? The pass key is"

Two haystacks (`haystack`):
  "repeat"  the five classic passkey sentences (`FILLER_SENTENCES`, no digits) repeated in an order drawn with
            the sample's seed (Mohtashami & Jaggi, 2023);
  "corpus"  a stretch of the user's corpus (the ppl corpus of `jsparse eval`, `--corpus`) at an offset drawn
            with the sample's seed: real text, harder for small models, and independent of the calibration
            corpus when the two differ (the bundled artifacts were calibrated on Alice, eval's default corpus is
            The Call of the Wild).
With "repeat", the text before the needle is whole sentences, as many as fit in `depth * F` filler tokens (F =
the filler tokens the length leaves), so the needle starts on a sentence boundary less than one sentence before
the requested depth; the text after it is cut to fill the length exactly (only its last sentence may be cut).
With "corpus", the needle goes in at round(depth * F) tokens into the stretch, which may be mid-sentence (the
corpus stretch is not cut at sentence boundaries; the eval/tasks haystacks are) but not mid-word: where that
token continues a word (a letter or digit on both sides of the cut), the needle moves back to the word's start
(`word_start`; before 2026-12-04 it split the word, "a por The pass key is ... pass key.cupine", in about 4% of
the prompts).
The model generates a few tokens greedily; a sample is correct when the first run of digits in the
completion is exactly the key.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from typing import Sequence

import numpy as np

INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. Find it and "
         "memorize it. I will quiz you about the important information there.")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"
DEFAULT_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)

# The classic passkey filler (Mohtashami & Jaggi, 2023): five short sentences repeated. Each prompt repeats
# them in its own seeded order. Varied, story-like filler makes the task much harder for small models: with
# 40 distinct sentences SmolLM2-135M retrieved 0/20 keys at 2K with dense attention, with these 3/3.
FILLER_SENTENCES = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)

_DIGITS = re.compile(r"\d+")


@dataclasses.dataclass(frozen=True)
class PasskeyPrompt:
    """One passkey sample.

    Attributes:
      tokens: i32[length] the prompt's token ids (special prefix included).
      key: the 5-digit pass key, as a string.
      depth: the requested depth, a fraction of the filler placed before the needle.
      needle_start: index in `tokens` of the needle's first token.
      needle_len: the needle's length in tokens.
      filler_start, filler_tokens: where the filler region (needle excluded) starts and how many filler tokens
        the prompt holds; the achieved depth is (needle_start - filler_start) / filler_tokens.
    """

    tokens: np.ndarray
    key: str
    depth: float
    needle_start: int
    needle_len: int
    filler_start: int
    filler_tokens: int

    @property
    def achieved_depth(self) -> float:
        return (self.needle_start - self.filler_start) / self.filler_tokens


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def word_start(tokenizer, ids: Sequence[int], cut: int) -> int:
    """The largest i <= cut at which ids[:i] and ids[i:] do not split a word: cut itself unless the token before
    it ends with a letter or digit and the token at it starts with one (then the start of that word; 0 at most)."""
    def joins(i):  # the pair decoded together: a SentencePiece token alone drops its leading space
        left, pair = tokenizer.decode([int(ids[i - 1])]), tokenizer.decode([int(ids[i - 1]), int(ids[i])])
        right = pair[len(left):] if pair.startswith(left) else ""
        return left[-1:].isalnum() and right[:1].isalnum()

    while 0 < cut < len(ids) and joins(cut):
        cut -= 1
    return cut


def special_prefix(tokenizer) -> list[int]:
    """The ids the tokenizer puts in front of a text when adding special tokens (e.g. [BOS]), maybe []."""
    probe = "Hello world"
    plain = _ids(tokenizer, probe)
    full = list(tokenizer(probe)["input_ids"])
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return full[:start]
    return []


def check_depths(depths: Sequence[float]) -> tuple[float, ...]:
    depths = tuple(float(d) for d in depths)
    if not depths:
        raise ValueError("no passkey depths given: expected at least one fraction in [0, 1]")
    for d in depths:
        if not 0.0 <= d <= 1.0:
            raise ValueError(f"passkey depth {d}: expected a fraction in [0, 1]")
    twice = sorted({d for d in depths if depths.count(d) > 1})
    if twice:  # the samples cycle over the depths: a repeated one would weigh twice and share one per-depth record
        raise ValueError(f"passkey depths {list(depths)} name depth {twice[0]:g} twice: expected each depth once")
    return depths


HAYSTACKS = ("repeat", "corpus")


def check_haystack(haystack: str) -> str:
    if haystack not in HAYSTACKS:
        raise ValueError(f"haystack={haystack!r}: expected one of {list(HAYSTACKS)}")
    return haystack


def make_prompt(tokenizer, length: int, depth: float, key: str, rng: np.random.Generator,
                corpus_ids: np.ndarray | None = None) -> PasskeyPrompt:
    """Builds a passkey prompt of exactly `length` tokens with the needle at `depth` of the filler.

    Args:
      tokenizer: a transformers tokenizer.
      length: the prompt's length in tokens.
      depth: fraction in [0, 1] of the filler tokens placed before the needle.
      key: the pass key (digits).
      rng: draws the order of the filler sentences (or the corpus offset).
      corpus_ids: i32[N] a tokenized corpus: the filler is N's stretch at a random offset ("corpus" haystack);
        None: the repeated classic sentences.
    """
    check_depths([depth])
    head = special_prefix(tokenizer) + _ids(tokenizer, INTRO)
    needle = _ids(tokenizer, " " + NEEDLE.format(key=key))
    tail = _ids(tokenizer, "\n" + QUESTION)  # on its own line: the filler before it may end mid-sentence
    filler_tokens = length - len(head) - len(needle) - len(tail)
    if filler_tokens < 1:
        raise ValueError(f"passkey length={length} tokens is too short: the instructions, needle and question "
                         f"alone take {length - filler_tokens} tokens with this tokenizer; expected a length "
                         f">= {length - filler_tokens + 1}")
    if corpus_ids is not None:
        corpus_ids = np.asarray(corpus_ids)
        if len(corpus_ids) < filler_tokens + 1:
            raise ValueError(f"the corpus has {len(corpus_ids)} tokens: a passkey prompt of {length} tokens needs "
                             f"at least {filler_tokens + 1} of filler; give a longer --corpus or a shorter length")
        start = int(rng.integers(0, len(corpus_ids) - filler_tokens))
        filler = [int(t) for t in corpus_ids[start:start + filler_tokens]]
        cut = word_start(tokenizer, filler, int(round(depth * filler_tokens)))
        tokens = head + filler[:cut] + needle + filler[cut:] + tail
        assert len(tokens) == length, (len(tokens), length)
        return PasskeyPrompt(tokens=np.asarray(tokens, np.int32), key=key, depth=float(depth),
                             needle_start=len(head) + cut, needle_len=len(needle), filler_start=len(head),
                             filler_tokens=filler_tokens)
    sentences = [_ids(tokenizer, " " + s) for s in FILLER_SENTENCES]

    order = rng.permutation(len(sentences))
    stream = (sentences[order[i % len(order)]] for i in itertools.count())  # the seeded order, repeated

    # Before the needle: whole sentences while they fit in depth * F tokens; after it, the stream goes on.
    target_before = int(round(depth * filler_tokens))
    before: list[int] = []
    s = next(stream)
    while len(before) + len(s) <= target_before:
        before += s
        s = next(stream)
    after: list[int] = []
    while len(after) < filler_tokens - len(before):
        after += s
        s = next(stream)
    after = after[: filler_tokens - len(before)]
    tokens = head + before + needle + after + tail
    assert len(tokens) == length, (len(tokens), length)
    return PasskeyPrompt(tokens=np.asarray(tokens, np.int32), key=key, depth=float(depth),
                         needle_start=len(head) + len(before), needle_len=len(needle), filler_start=len(head),
                         filler_tokens=filler_tokens)


def make_prompts(tokenizer, length: int, samples: int, seed: int,
                 depths: Sequence[float] = DEFAULT_DEPTHS, corpus_ids: np.ndarray | None = None) -> list[PasskeyPrompt]:
    """`samples` prompts of `length` tokens; sample i has depth depths[i % len(depths)] and a random key.

    The keys and filler depend only on (seed, length, i) (and the corpus), so every method sees the same prompts.
    corpus_ids: the "corpus" haystack's tokens (see `make_prompt`); None: the repeated classic sentences.
    """
    if samples < 1:
        raise ValueError(f"samples={samples}: expected >= 1")
    depths = check_depths(depths)
    prompts = []
    for i in range(samples):
        rng = np.random.default_rng([seed, length, i])
        key = str(int(rng.integers(10000, 100000)))
        prompts.append(make_prompt(tokenizer, length, depths[i % len(depths)], key, rng, corpus_ids))
    return prompts


def extract_answer(completion: str) -> str | None:
    """The first run of digits in the completion, or None."""
    m = _DIGITS.search(completion)
    return m.group(0) if m else None


def is_correct(completion: str, key: str) -> bool:
    """Exact match of the completion's first run of digits with the key."""
    return extract_answer(completion) == key
