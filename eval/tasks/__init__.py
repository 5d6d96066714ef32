"""Generated evaluation tasks (RULER-style and the older passkey / co-reference), all behind one interface.

    from eval.tasks import get_task, score
    task = get_task("niah_single_number")
    samples = task.make_samples(tokenizer, 4096, samples=10, seed=0, haystack="repeat", chat=False)
    # generate task.max_new_tokens tokens greedily after each sample.tokens, decode, then
    s = score(task, completion, samples[0].answers)            # in [0, 1]

Registered tasks (module: names): niah_single: niah_single_number, niah_single_word, niah_single_uuid;
niah_multikey; niah_multivalue; niah_multiquery; vt (variable tracking); cwe (common words); fwe (frequent words);
passkey and coref (the prompts of eval.passkey and eval.coref). Shared machinery: `common` (haystacks, chat template,
token-space assembly, word sources), `niah` (the needle template), `words` (the word lists).

`Sample`, `Task`, the metrics and `score` are defined in `eval.tasks.base`; each task lives in its own module
(module docstrings: the task, its metric and how it differs from RULER); `TASKS` maps every registered name to
its Task.
"""

from __future__ import annotations

from eval.tasks import (coref, cwe, fwe, niah_multikey, niah_multiquery, niah_multivalue, niah_single, passkey,
                        vt)
from eval.tasks.base import METRICS, Sample, Task, score, string_match_all, string_match_part

__all__ = ["METRICS", "Sample", "Task", "TASKS", "get_task", "score", "string_match_all", "string_match_part"]

TASKS: dict[str, Task] = {}
for _module in (niah_single, niah_multikey, niah_multivalue, niah_multiquery, vt, cwe, fwe, passkey, coref):
    for _task in _module.TASKS:
        if _task.name in TASKS:
            raise ValueError(f"task {_task.name!r} registered twice")  # pragma: no cover
        TASKS[_task.name] = _task


def get_task(name: str) -> Task:
    """The registered task called `name`; ValueError naming it and listing the known ones otherwise."""
    task = TASKS.get(name)
    if task is None:
        raise ValueError(f"unknown task {name!r}: expected one of {sorted(TASKS)}")
    return task
