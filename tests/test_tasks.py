"""The generated tasks (eval/tasks/): every registered task at two lengths with the bundled tokenizer (no model
forward): the answers sit in the prompt exactly where they should, lengths hit the request within 1%, the seed
reproduces the prompt and another seed changes it, both haystacks and chat mode work; the metrics on
hand-made predictions; errors name the bad value."""

from __future__ import annotations

import re

import pytest

from eval import tasks as tasks_pkg
from eval.tasks import TASKS, Sample, get_task, score, string_match_all, string_match_part
from eval.tasks import common

LENGTHS = (512, 4096)


@pytest.fixture(scope="module")
def tokenizer():
    from models.bundled import resolve_model
    from models.gguf_loader import open_gguf
    from models.tokenizer import gguf_tokenizer

    path = resolve_model("smollm2").path
    return gguf_tokenizer(open_gguf(path), path)


def _text(tokenizer, sample: Sample) -> str:
    return tokenizer.decode(list(sample.tokens), skip_special_tokens=False)


def _check_niah(tokenizer, sample: Sample) -> None:
    text = _text(tokenizer, sample)
    m = re.search(r"What are all the special magic (\w+) for (.+) mentioned in the provided text\?", text)
    assert m, text[-300:]
    kind, query = m.groups()
    assert text.rstrip().endswith(f"The special magic {kind} for {query} mentioned in the provided text are")
    keys = [k.strip() for k in re.split(r",| and ", query)]
    needles = re.findall(rf"One of the special magic {kind} for ([\w-]+) is: ([\w-]+)\.", text)
    asked = [v for k, v in needles if k in keys]
    assert sorted(asked) == sorted(sample.answers)
    for a in sample.answers:
        assert common.count(text, a) == 1, a  # once: in its needle
    for k, v in needles:
        if k not in keys:  # a distractor: another key, another value
            assert v not in sample.answers and all(v not in a and a not in v for a in sample.answers)
            assert common.count(text, k) == 1
    for k in keys:
        assert common.count(text, k) == 2 + sum(nk == k for nk, _ in needles)


CHECKS = {name: _check_niah for name in TASKS if name.startswith("niah_")}


def test_every_task_has_a_check_and_a_doc():
    assert set(CHECKS) == set(TASKS)
    for name, task in TASKS.items():
        assert task.name == name and task.doc and "\n" not in task.doc
        assert task.metric in ("string_match_all", "string_match_part") and task.max_new_tokens >= 1
        module = task.make_samples.__module__
        assert module.startswith("eval.tasks.") and __import__(module, fromlist=["_"]).__doc__


@pytest.mark.parametrize("name", sorted(TASKS))
@pytest.mark.parametrize("length", LENGTHS)
def test_task_samples(tokenizer, name, length):
    task = get_task(name)
    samples = task.make_samples(tokenizer, length, 5, seed=1)
    assert len(samples) == 5
    for s in samples:
        assert s.task == name and s.length == length
        assert abs(len(s.tokens) - length) <= 0.01 * length, (len(s.tokens), length)
        assert all(isinstance(t, int) for t in s.tokens) and s.answers
        CHECKS[name](tokenizer, s)
        assert score(task, " ".join(s.answers), s.answers) == 1.0
        assert score(task, "", s.answers) == 0.0
    depths = [s.depth for s in samples]
    if depths[0] is not None:
        assert depths == [0.1, 0.3, 0.5, 0.7, 0.9]
    assert task.make_samples(tokenizer, length, 5, seed=1) == samples
    other = task.make_samples(tokenizer, length, 5, seed=2)
    assert all(a.tokens != b.tokens for a, b in zip(samples, other))


@pytest.mark.parametrize("name", sorted(TASKS))
def test_task_corpus_and_chat(tokenizer, name, tmp_path):
    task = get_task(name)
    for haystack in ("corpus", None):
        if haystack is None:  # a user's file
            haystack = tmp_path / "story.txt"
            haystack.write_text(("A quiet boat drifted down the long river at dawn. Nobody was watching it. "
                                 "The reeds bent in the cold wind!\n\n") * 200)
        for chat in (False, True):
            samples = task.make_samples(tokenizer, 1024, 2, seed=0, haystack=str(haystack), chat=chat)
            for s in samples:
                assert abs(len(s.tokens) - 1024) <= 10.24
                CHECKS[name](tokenizer, s)
                text = _text(tokenizer, s)
                assert text.startswith("<|im_start|>system") == chat
                assert ("<|im_start|>assistant\n" in text) == chat


def test_metrics():
    assert string_match_all("The numbers are 123 and 456.", ["123", "456"]) == 1.0
    assert string_match_all("The numbers are 123 and 789.", ["123", "456"]) == 0.5
    assert string_match_all("nothing", ["123", "456"]) == 0.0
    assert string_match_all("APPLE pie", ["apple"]) == 1.0  # case-insensitive
    assert string_match_part("only 456 here", ["123", "456"]) == 1.0
    assert string_match_part("neither", ["123", "456"]) == 0.0
    assert string_match_all("abc", "abc") == 1.0  # one string is one answer, not its characters
    with pytest.raises(ValueError, match="no reference answers"):
        string_match_all("x", [])
    part = tasks_pkg.Task(name="t", metric="string_match_part", max_new_tokens=1, make_samples=lambda: [], doc="d")
    assert score(part, "a b", ["b", "c"]) == 1.0
    assert score(get_task("niah_single_number"), "1 2", ["1", "3"]) == 0.5


def test_errors_name_the_value(tokenizer, tmp_path):
    with pytest.raises(ValueError, match=r"unknown task 'niah_nope'.*niah_single_number"):
        get_task("niah_nope")
    with pytest.raises(ValueError, match="metric='bleu'"):
        tasks_pkg.Task(name="t", metric="bleu", max_new_tokens=1, make_samples=lambda: [], doc="d")
    for name in TASKS:
        make = get_task(name).make_samples
        with pytest.raises(ValueError, match=r"length=40 is too short.*expected a length >= \d+"):
            make(tokenizer, 40, 1, 0)
        with pytest.raises(ValueError, match="length=-5"):
            make(tokenizer, -5, 1, 0)
        with pytest.raises(ValueError, match="samples=0"):
            make(tokenizer, 1024, 0, 0)
        with pytest.raises(ValueError, match="haystack='nowhere.txt'"):
            make(tokenizer, 1024, 1, 0, haystack="nowhere.txt")
    short = tmp_path / "short.txt"
    short.write_text("One sentence only. Two.\n")
    with pytest.raises(ValueError, match=r"short.txt' has \d+ tokens, fewer than the \d+"):
        get_task("niah_single_number").make_samples(tokenizer, 1024, 1, 0, haystack=str(short))


def test_chat_needs_a_template(tokenizer):
    class NoTemplate:
        chat_template = None
        name_or_path = "plain"

    with pytest.raises(ValueError, match="'plain'.*has no chat template"):
        common.chat_pieces(NoTemplate())
