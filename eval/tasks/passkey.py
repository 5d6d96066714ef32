"""Passkey retrieval (`eval.passkey`) as a registered task: a 5-digit key in filler text, asked back at the end.

Raw mode gives exactly `eval.passkey.make_prompts`' prompts (the harness's passkey prompts for the same seed and
haystack): sample i has depth DEPTHS[i % 5] = 0.1, 0.3, 0.5, 0.7, 0.9. haystack "repeat" is passkey's classic
five sentences in a seeded order, "corpus" / a path a stretch of that text. Chat mode puts the intro, filler and
"What is the pass key?" in the user's turn and "The pass key is" after the template's assistant header.
Metric: string_match_all (the key found in the completion; `eval.passkey.is_correct`, which the harness uses,
asks for the completion's first run of digits to equal the key).

Not a RULER task (Mohtashami & Jaggi, 2023); RULER's niah_single_1 is its closest relative.
"""

from __future__ import annotations

import numpy as np

from eval import passkey as passkey_prompts
from eval.tasks import common
from eval.tasks.base import Sample, Task

NAME = "passkey"
USER_QUESTION = "\nWhat is the pass key?"
ANSWER = "The pass key is"


def make_samples(tokenizer, length: int, samples: int, seed: int, *, haystack: str = "repeat", chat: bool = False):
    """passkey samples (see the module docstring)."""
    common.check_request(NAME, length, samples)
    haystack = common.check_haystack(haystack)
    corpus_ids = None if haystack == "repeat" else common.corpus_tokens(tokenizer, haystack).ids
    depths = passkey_prompts.DEFAULT_DEPTHS
    if not chat:
        prompts = passkey_prompts.make_prompts(tokenizer, length, samples, seed, depths, corpus_ids)
        return [Sample(task=NAME, tokens=tuple(int(t) for t in p.tokens), answers=(p.key,), depth=p.depth,
                       length=length) for p in prompts]
    before, after = common.chat_pieces(tokenizer)
    special = passkey_prompts.special_prefix(tokenizer)
    tail = common.ids(tokenizer, "\n" + passkey_prompts.QUESTION)
    question, answer = common.ids(tokenizer, USER_QUESTION), common.ids(tokenizer, ANSWER)
    overhead = len(before) + len(question) + len(after) + len(answer) - len(special) - len(tail)
    out = []
    for i in range(samples):
        rng = np.random.default_rng([seed, length, i])  # as make_prompts: the same key and filler as raw mode
        key = str(int(rng.integers(10000, 100000)))
        try:
            p = passkey_prompts.make_prompt(tokenizer, length - overhead, depths[i % len(depths)], key, rng,
                                            corpus_ids)
        except ValueError as e:
            raise ValueError(f"task {NAME!r}: length={length} with the chat template ({overhead} tokens) leaves "
                             f"{length - overhead} for the prompt: {e}") from None
        body = [int(t) for t in p.tokens[len(special):len(p.tokens) - len(tail)]]
        tokens = before + body + question + after + answer
        assert len(tokens) == length, (len(tokens), length)
        out.append(Sample(task=NAME, tokens=tuple(tokens), answers=(key,), depth=p.depth, length=length))
    return out


TASKS = (Task(name=NAME, metric="string_match_all", max_new_tokens=8, make_samples=make_samples,
              doc="retrieve a 5-digit pass key hidden at a given depth in filler text"),)
