"""Variable tracking (RULER's vt): a chain of assignments "VAR X1 = 12345.", "VAR X2 = VAR X1.", ... spread over a
haystack; the question asks for every variable that holds the value.

    HEAD    "Memorize and track the chain(s) of variable assignment hidden in the following text."
    chain   "VAR {X1} = {value}." then, one hop each, "VAR {Xj+1} = VAR {Xj}." (HOPS = 4: five variables)
    TAIL    "Question: Find all variables that are assigned the value {value} in the text above."
    ANSWER  "Answer: According to the chain(s) of variable assignment in the text above, 5 variables are assigned
             the value {value}, they are:"

Variables are five seeded uppercase letters, the value a 5-digit number; the statements sit in chain order at
seeded depths (Sample.depth None). CHAINS = 1 as RULER's default; with more, the first chain is asked and the
others (own variables and values) are interleaved distractors. Metric: string_match_all (the fraction of the
asked chain's five variables found in the completion).

Differences from RULER: RULER's typo "assgined" is not kept; the haystack is the run's ("repeat", "corpus" or a
user's file); 48 new tokens instead of 30: SmolLM2's tokenizer spells the five "VAR ABCDE" names of a whole answer
in 31-34 tokens, so 32 cut a right answer short (14 of 40 samples scored below 1).
"""

from __future__ import annotations

import string

import numpy as np

from eval.tasks import common
from eval.tasks.base import Sample, Task

NAME = "vt"
HOPS = 4
CHAINS = 1
HEAD = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n"
FIRST = " VAR {var} = {value}."
HOP = " VAR {var} = VAR {prev}."
TAIL = "\nQuestion: Find all variables that are assigned the value {value} in the text above."
ANSWER = (" Answer: According to the chain(s) of variable assignment in the text above, {n} variables are assigned "
          "the value {value}, they are:")


def _var(rng: np.random.Generator) -> str:
    return "".join(rng.choice(list(string.ascii_uppercase), size=5))


def make_samples(tokenizer, length: int, samples: int, seed: int, *, haystack: str = "repeat", chat: bool = False):
    """vt samples (see the module docstring); answers: the asked chain's variables, in chain order."""
    common.check_request(NAME, length, samples)
    haystack = common.check_haystack(haystack)
    out = []
    for i in range(samples):
        rng = common.sample_rng(NAME, seed, length, i)

        def build():
            names = common.distinct(rng, _var, CHAINS * (HOPS + 1), avoid=("VAR",))
            values = common.distinct(rng, lambda r: str(int(r.integers(10_000, 100_000))), CHAINS)
            chains = [names[c * (HOPS + 1):(c + 1) * (HOPS + 1)] for c in range(CHAINS)]
            pieces, expected = [], {}
            for c, (chain, value) in enumerate(zip(chains, values)):
                depths = np.sort(rng.uniform(0.0, 1.0, size=HOPS + 1))
                texts = [FIRST.format(var=chain[0], value=value)]
                texts += [HOP.format(var=chain[j], prev=chain[j - 1]) for j in range(1, HOPS + 1)]
                pieces += [(common.ids(tokenizer, t), float(d)) for t, d in zip(texts, depths)]
                expected[value] = 1 + (2 if c == 0 else 0)  # its assignment; the asked one also in the question
                expected.update({v: 2 for v in chain[:-1]})  # assigned, then read by the next hop
                expected[chain[-1]] = 1
            prefix, suffix = common.frame(tokenizer, HEAD, TAIL.format(value=values[0]),
                                          ANSWER.format(n=HOPS + 1, value=values[0]), chat)
            tokens = common.assemble(tokenizer, NAME, length, prefix, suffix, pieces, haystack, rng)
            return tokens, expected, tuple(chains[0])

        tokens, answers = common.retry(NAME, build, tokenizer)
        out.append(Sample(task=NAME, tokens=tuple(tokens), answers=answers, depth=None, length=length))
    return out


TASKS = (Task(name=NAME, metric="string_match_all", max_new_tokens=48, make_samples=make_samples,
              doc="find every variable of a 4-hop chain of assignments to one value"),)
