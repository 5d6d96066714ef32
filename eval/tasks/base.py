"""The task interface shared by every generated task: `Sample`, `Task` and RULER's two string metrics.

A task turns (tokenizer, length, samples, seed) into `Sample`s: prompts as token ids whose length is within 1%
of the requested length (the registered tasks hit it exactly), the reference strings, and the needle depth where the task
has one. A model answers a sample by greedy generation of at most `Task.max_new_tokens` tokens after the prompt
(the prompt ends with an answer prefix, so a raw-completion model continues with the value); `score` compares
the decoded completion with the references by the task's metric.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

METRICS = ("string_match_all", "string_match_part")


@dataclasses.dataclass(frozen=True)
class Sample:
    """One prompt of a task.

    Attributes:
      task: the registry name of the task that made it, e.g. "niah_single_number".
      tokens: the full prompt's token ids (special prefix or chat template included). The interface allows a
        length within 1% of `length`; every task registered here makes exactly `length` tokens, so the samples of
        one (task, length) batch without padding.
      answers: the reference strings (all of them are wanted for "string_match_all", any one for "_part").
      depth: the requested depth in [0, 1] of the queried needle (fraction of the haystack before it) when the
        task has one needle to find, else None.
      length: the requested length in tokens.
    """

    task: str
    tokens: tuple[int, ...]
    answers: tuple[str, ...]
    depth: float | None
    length: int


@dataclasses.dataclass(frozen=True)
class Task:
    """A registered task.

    Attributes:
      name: the registry name.
      metric: "string_match_all" or "string_match_part" (see `score`).
      max_new_tokens: tokens to generate greedily for an answer.
      make_samples: (tokenizer, length: int, samples: int, seed: int, *, haystack: str = "repeat", chat: bool =
        False) -> list[Sample]. haystack: "repeat" (RULER's noise sentences), "corpus" (the shipped default
        corpus, eval/data/call_of_the_wild.txt) or a path to a UTF-8 text file; chat: wrap the prompt with the
        tokenizer's chat template (the answer prefix then opens the assistant's turn).
      doc: one line: what the task measures.
      exact_length: the prompts have exactly `length` tokens (every task registered here; tests/test_tasks.py
        checks it). False for a task that only meets the interface's 1%: the harness then sizes the cache and
        the length checks for int(length * 1.01) + 1 prompt tokens.
    """

    name: str
    metric: str
    max_new_tokens: int
    make_samples: Callable
    doc: str
    exact_length: bool = True

    def max_prompt(self, length: int) -> int:
        """The most prompt tokens a sample of `length` may have."""
        return length if self.exact_length else int(length * 1.01) + 1

    def __post_init__(self):
        if self.metric not in METRICS:
            raise ValueError(f"task {self.name!r}: metric={self.metric!r}, expected one of {list(METRICS)}")
        if self.max_new_tokens < 1:
            raise ValueError(f"task {self.name!r}: max_new_tokens={self.max_new_tokens}, expected >= 1")


def _check_answers(answers: Sequence[str]) -> list[str]:
    if isinstance(answers, str):
        answers = [answers]
    answers = list(answers)
    if not answers:
        raise ValueError("no reference answers given: expected at least one string")
    return answers


def string_match_all(prediction: str, answers: Sequence[str]) -> float:
    """RULER's `string_match_all`: the fraction of the answers found in the prediction (case-insensitive
    substring), in [0, 1]. As in RULER, a substring counts: a wrong, longer number that contains the answer
    ("12345678" for "1234567") scores (passkey's `eval.passkey.is_correct` is stricter: the first digit run)."""
    answers = _check_answers(answers)
    pred = prediction.lower()
    return sum(a.lower() in pred for a in answers) / len(answers)


def string_match_part(prediction: str, answers: Sequence[str]) -> float:
    """RULER's `string_match_part`: 1.0 when any answer is found in the prediction (case-insensitive substring),
    else 0.0."""
    answers = _check_answers(answers)
    pred = prediction.lower()
    return float(any(a.lower() in pred for a in answers))


_METRIC_FNS = {"string_match_all": string_match_all, "string_match_part": string_match_part}


def score(task: Task, prediction: str, answers) -> float:
    """The score in [0, 1] of one decoded completion against a sample's answers, by the task's metric."""
    return _METRIC_FNS[task.metric](prediction, answers)
