"""Co-reference retrieval (`eval.coref`, TokenButler's task) as a registered task: "{name} put the {object} in the
{location}." early in a story with distractor facts, then "Where did {name} put the {object}?".

Raw mode gives exactly `eval.coref.make_prompts`' prompts (its whole prompt: context and question); the answer prefix
is "Answer: {name} put the {object} in the". Its haystack is always its own pool of story sentences (the distractor
facts are part of the task): `haystack` is checked like every task's ("repeat", "corpus" or a path to an existing
file) and otherwise not used, so a sweep with `--haystack corpus` runs coref on the same prompts as with "repeat".
Chat mode puts the story and "Question: Where did {name} put the
{object}?" in the user's turn and "{name} put the {object} in the" after the template's assistant header.
Metric: string_match_part (the location found in the completion; `eval.coref.is_correct`, which `run_coref` uses,
asks for the completion to start with it). Sample.depth is None (the fact is always at the start).

Not a RULER task; `eval.coref.run_coref` runs it with the question decoded token by token (so every question
token selects its own keys); a harness that prefills the whole prompt instead measures the prefill's selection.
"""

from __future__ import annotations

import numpy as np

from eval import coref as coref_prompts
from eval.passkey import special_prefix
from eval.tasks import common
from eval.tasks.base import Sample, Task

NAME = "coref"
USER_QUESTION = "\n\nQuestion: Where did {name} put the {object}?"
ANSWER = "{name} put the {object} in the"


def make_samples(tokenizer, length: int, samples: int, seed: int, *, haystack: str = "repeat", chat: bool = False):
    """coref samples (see the module docstring; `haystack` is validated, not used: the story is its own)."""
    common.check_request(NAME, length, samples)
    common.check_haystack(haystack)
    if not chat:
        return [Sample(task=NAME, tokens=tuple(int(t) for t in p.tokens), answers=(p.answer,), depth=None,
                       length=length) for p in coref_prompts.make_prompts(tokenizer, length, samples, seed)]
    before, after = common.chat_pieces(tokenizer)
    special = special_prefix(tokenizer)
    out = []
    for i in range(samples):
        target = length
        for _ in range(2):  # the draws come first, so the second pass has the same names and the exact overhead
            try:
                p = coref_prompts.make_prompt(tokenizer, target, np.random.default_rng([seed, length, i]))
            except ValueError as e:
                raise ValueError(f"task {NAME!r}: length={length} with the chat template leaves {target} tokens for "
                                 f"the prompt: {e}") from None
            body = [int(t) for t in p.tokens[len(special):p.context_len]]
            tokens = (before + body + common.ids(tokenizer, USER_QUESTION.format(name=p.name, object=p.object))
                      + after + common.ids(tokenizer, ANSWER.format(name=p.name, object=p.object)))
            target -= len(tokens) - length
        assert len(tokens) == length, (len(tokens), length)
        out.append(Sample(task=NAME, tokens=tuple(tokens), answers=(p.answer,), depth=None, length=length))
    return out


TASKS = (Task(name=NAME, metric="string_match_part", max_new_tokens=4, make_samples=make_samples,
              doc="recall where a character put an object, stated once early in a long story with distractor facts"),)
