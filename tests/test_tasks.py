"""The generated tasks (eval/tasks/): every registered task at two lengths with the bundled tokenizer (no model
forward): the answers sit in the prompt exactly where they should, lengths hit the request within 1%, the seed
reproduces the prompt and another seed changes it, both haystacks and chat mode work; the metrics on
hand-made predictions; errors name the bad value."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from eval import tasks as tasks_pkg
from eval.tasks import TASKS, Sample, get_task, score, string_match_all, string_match_part
from eval.tasks import common
from eval.ppl import DEV_CORPUS
from eval.tasks.words import NOUNS

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


def _check_vt(tokenizer, sample: Sample) -> None:
    text = _text(tokenizer, sample)
    value = re.search(r"Find all variables that are assigned the value (\d+) in the text above\.", text).group(1)
    assert text.endswith(f"5 variables are assigned the value {value}, they are:")
    chain = [re.search(rf"VAR ([A-Z]{{5}}) = {value}\.", text).group(1)]
    for _ in range(4):  # each hop reads the previous variable, and comes after it
        m = re.search(rf"VAR ([A-Z]{{5}}) = VAR {chain[-1]}\.", text)
        assert m and m.start() > text.index(f"VAR {chain[-1]} =")
        chain.append(m.group(1))
    assert tuple(chain) == sample.answers
    assert common.count(text, value) == 3  # assigned, asked, in the answer prefix
    for j, var in enumerate(chain):
        assert common.count(text, var) == (1 if j == len(chain) - 1 else 2), var
    assert text.count("VAR ") == 4 + 5


def _check_cwe(tokenizer, sample: Sample) -> None:
    text = _text(tokenizer, sample)
    assert text.endswith("Answer: The top 10 words that appear most often in the list are:")
    items = re.findall(r"^(\d+)\. (\S+)$", text, flags=re.M)
    assert [int(i) for i, _ in items] == list(range(1, len(items) + 1))
    counts = {}
    for _, w in items:
        counts[w] = counts.get(w, 0) + 1
    assert len(sample.answers) == 10 and set(sample.answers) <= set(counts)
    rest = [c for w, c in counts.items() if w not in sample.answers]
    assert min(counts[a] for a in sample.answers) > max(rest) and len(set(counts[a] for a in sample.answers)) == 1
    words = list(counts)
    assert not any(a != b and a in b for a in words for b in words)  # a substring match finds only its word


def _check_fwe(tokenizer, sample: Sample) -> None:
    text = _text(tokenizer, sample)
    assert text.endswith("the three most frequently appeared words are:")
    body = text[text.index("coded words.\n") + len("coded words.\n"):text.index("\nQuestion:")]
    counts = {}
    for w in body.split():
        counts[w] = counts.get(w, 0) + 1
    ranked = sorted(counts.values(), reverse=True)
    assert tuple(sorted(counts, key=lambda w: -counts[w])[:3]) == sample.answers
    assert ranked[0] > ranked[1] > ranked[2] > ranked[3]


def _check_passkey(tokenizer, sample: Sample) -> None:
    text = _text(tokenizer, sample)
    (key,) = sample.answers
    assert text.count(key) == 2 and f"The pass key is {key}. Remember it. {key} is the pass key." in text
    assert text.endswith("The pass key is")


def _check_coref(tokenizer, sample: Sample) -> None:
    text = _text(tokenizer, sample)
    m = re.search(r"Question: Where did (\w+) put the ([\w ]+)\?", text)
    name, obj = m.groups()
    assert text.endswith(f"{name} put the {obj} in the")
    (loc,) = sample.answers
    assert f"{name} put the {obj} in the {loc}." in text[:text.index("Question:")]
    assert len(re.findall(rf"\b{loc}\b", text)) == 1


CHECKS = {name: _check_niah for name in TASKS if name.startswith("niah_")}
CHECKS.update(vt=_check_vt, cwe=_check_cwe, fwe=_check_fwe, passkey=_check_passkey, coref=_check_coref)


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
        assert abs(len(s.tokens) - length) <= 0.01 * length, (len(s.tokens), length)  # the interface
        assert len(s.tokens) == length  # what the registered tasks promise beyond it
        assert all(isinstance(t, int) for t in s.tokens) and s.answers
        CHECKS[name](tokenizer, s)
        assert score(task, " ".join(s.answers), s.answers) == 1.0
        assert score(task, "", s.answers) == 0.0
        if name == "vt":  # a whole answer in the form the prompt teaches fits the task's new tokens
            answer = " " + ", ".join(f"VAR {v}" for v in s.answers) + "."
            assert len(tokenizer(answer, add_special_tokens=False)["input_ids"]) <= task.max_new_tokens, answer
    depths = [s.depth for s in samples]
    if depths[0] is not None:
        assert depths == [0.1, 0.3, 0.5, 0.7, 0.9]
    assert task.make_samples(tokenizer, length, 5, seed=1) == samples
    other = task.make_samples(tokenizer, length, 5, seed=2)
    assert all(a.tokens != b.tokens for a, b in zip(samples, other))


@pytest.mark.parametrize("name", sorted(TASKS))
def test_task_corpus_and_chat(tokenizer, name, tmp_path):
    task = get_task(name)
    if name == "coref":  # its own story sentences whatever the haystack (a sweep's corpus), chat mode works
        for chat in (False, True):
            plain = task.make_samples(tokenizer, 1024, 2, seed=0, chat=chat)
            for haystack in ("corpus", str(DEV_CORPUS)):
                assert task.make_samples(tokenizer, 1024, 2, seed=0, haystack=haystack, chat=chat) == plain
            for s in plain:
                assert len(s.tokens) == 1024 and _text(tokenizer, s).startswith("<|im_start|>system") == chat
                CHECKS[name](tokenizer, s)
        with pytest.raises(ValueError, match="haystack='no-such-file.txt'"):  # a bad haystack is still an error
            task.make_samples(tokenizer, 1024, 1, 0, haystack="no-such-file.txt")
        return
    for haystack in ("corpus", DEV_CORPUS):  # the shipped default, and a user's file
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
        for chat in (False, True):
            with pytest.raises(ValueError, match=r"length=40\b.*too short.*expected (a length >=|at least) \d+"):
                make(tokenizer, 40, 1, 0, chat=chat)
        with pytest.raises(ValueError, match="length=-5"):
            make(tokenizer, -5, 1, 0)
        with pytest.raises(ValueError, match="samples=0"):
            make(tokenizer, 1024, 0, 0)
        with pytest.raises(ValueError, match="haystack='nowhere.txt'"):
            make(tokenizer, 1024, 1, 0, haystack="nowhere.txt")
    story = tmp_path / "story.txt"  # a file of few distinct words: enough haystack for a needle, not for cwe
    story.write_text("A quiet boat drifted down the long river at dawn. Nobody was watching it!\n\n" * 300)
    assert get_task("niah_single_word").make_samples(tokenizer, 1024, 1, 0, haystack=str(story))
    with pytest.raises(ValueError, match=r"the word pool \(\d+ words\) has fewer than 10 usable words"):
        get_task("cwe").make_samples(tokenizer, 4096, 1, 0, haystack=str(story))
    few = tmp_path / "few.txt"  # 30 distinct words: too few to keep ten of them the most common at 4096 tokens
    few.write_text(" ".join(NOUNS[:30]) + ".\n")
    with pytest.raises(ValueError, match=r"length=4096 needs more distinct words than the 30 of the word pool"):
        get_task("cwe").make_samples(tokenizer, 4096, 1, 0, haystack=str(few))
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


def test_bundled_model_answers_niah_single_number():
    """End to end: the bundled SmolLM2-135M with dense attention, prefill + greedy generation of
    max_new_tokens, finds the number of 512-token niah_single_number prompts (5 of 5 found with seed 0, raw and
    chat; greedy decoding on CPU is deterministic, and the bound leaves one miss of slack)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jsparse.methods import make_method
    from models.bundled import load_model
    from models.generate import Sampling, check_request, generate_tokens

    model = load_model("smollm2", jnp.float32)
    task = get_task("niah_single_number")
    samples = task.make_samples(model.tokenizer, 512, 3, seed=0)
    tokens = np.stack([np.asarray(s.tokens, np.int32) for s in samples])  # i32[3, 512]
    B, T = tokens.shape
    eos = (model.tokenizer.eos_token_id,)
    out, num = generate_tokens(model.params, make_method("dense"), jnp.asarray(tokens), jnp.full((B,), T, jnp.int32),
                               jax.random.key(0), cfg=model.cfg, max_new_tokens=task.max_new_tokens,
                               capacity=check_request(model.cfg, [T], task.max_new_tokens), sampling=Sampling(),
                               eos_ids=eos)
    out, num = np.asarray(out), np.asarray(num)
    preds = [model.tokenizer.decode([int(t) for t in row[:n] if t >= 0 and int(t) not in eos])
             for row, n in zip(out, num)]
    scores = [score(task, p, s.answers) for p, s in zip(preds, samples)]
    assert all(0.0 <= x <= 1.0 for x in scores)
    assert sum(scores) >= 2, list(zip(preds, [s.answers for s in samples]))


def test_passkey_and_coref_wrap_the_harness_prompts(tokenizer):
    """Raw mode gives exactly the prompts of eval.passkey / eval.coref (the harness's own, for one seed)."""
    from eval import coref, passkey

    corpus_ids = common.corpus_tokens(tokenizer, "corpus").ids
    for haystack, ids in (("repeat", None), ("corpus", corpus_ids)):
        ours = get_task("passkey").make_samples(tokenizer, 1024, 5, seed=3, haystack=haystack)
        theirs = passkey.make_prompts(tokenizer, 1024, 5, 3, passkey.DEFAULT_DEPTHS, ids)
        assert [s.tokens for s in ours] == [tuple(p.tokens.tolist()) for p in theirs]
        assert [s.answers for s in ours] == [(p.key,) for p in theirs]
        chat = get_task("passkey").make_samples(tokenizer, 1024, 5, seed=3, haystack=haystack, chat=True)
        assert [s.answers for s in chat] == [s.answers for s in ours]  # same keys and filler draws
    ours = get_task("coref").make_samples(tokenizer, 1024, 3, seed=3)
    theirs = coref.make_prompts(tokenizer, 1024, 3, seed=3)
    assert [s.tokens for s in ours] == [tuple(p.tokens.tolist()) for p in theirs]
    assert [s.answers for s in ours] == [(p.answer,) for p in theirs]


def test_fwe_corpus_words_run_out_with_a_clear_error(tokenizer, tmp_path):
    few = tmp_path / "few.txt"  # 40 distinct words: the ranked words fit, the words of count 1 run out
    few.write_text(" ".join(NOUNS[:40]) + ".\n")
    with pytest.raises(ValueError, match=r"length=4096: the word source ran out of distinct words after \d+"):
        get_task("fwe").make_samples(tokenizer, 4096, 1, 0, haystack=str(few))


def test_cwe_gap_the_words_cannot_close_is_padded(tokenizer):
    """At 3044 tokens (seed 6) the repo's word pool is nearly used up and swaps cannot close the last 2 tokens: blank
    lines before the question do, and the list is still right."""
    samples = []
    for chat in (False, True):
        samples += get_task("cwe").make_samples(tokenizer, 3044, 4, 6, chat=chat)
    for s in samples:
        assert len(s.tokens) == 3044
        _check_cwe(tokenizer, s)
    assert any("\n\n\nQuestion:" in _text(tokenizer, s) for s in samples)


@pytest.mark.parametrize("name", ["niah_multikey", "niah_single_number"])
def test_queried_needle_sits_at_the_requested_depth(tokenizer, name):
    """The queried needle of a one-needle-to-find niah task sits at the sample's depth (the share of the filler
    before it), not a distractor."""
    samples = get_task(name).make_samples(tokenizer, 4096, 5, seed=1)
    for s in samples:
        text = tokenizer.decode(list(s.tokens), skip_special_tokens=False)
        start = text.index("afterwards.\n") + len("afterwards.\n")
        end = text.index("\nWhat are all the special magic")
        query = re.search(r"What are all the special magic \w+ for (.+?) mentioned", text).group(1)
        body = text[start:end]
        needle = re.compile(r" ?One of the special magic \w+ for ([\w-]+) is: [\w-]+\.")
        # The filler alone (needles cut out), and the filler characters before the queried needle.
        filler_before, filler, pos = None, 0, 0
        for m in needle.finditer(body):
            filler += m.start() - pos
            pos = m.end()
            if m.group(1) == query:
                filler_before = filler
        filler += len(body) - pos
        assert filler_before is not None, query
        assert abs(filler_before / filler - s.depth) < 0.03, (name, s.depth, filler_before / filler)


class BosTokenizer:
    """The bundled tokenizer, adding a BOS id in front when add_special_tokens (as Llama's does)."""

    def __init__(self, tok, bos):
        self._tok, self.bos = tok, bos

    def __call__(self, text, add_special_tokens=True, **kw):
        ids = list(self._tok(text, add_special_tokens=False, **kw)["input_ids"])
        return {"input_ids": ([self.bos] if add_special_tokens else []) + ids}

    def __getattr__(self, name):
        return getattr(self._tok, name)


def test_coref_chat_body_has_no_bos(tokenizer):
    """coref's chat mode puts the story in the user's turn without the tokenizer's BOS (mutation
    `p.tokens[len(special):p.context_len]` -> `p.tokens[:p.context_len]` in eval/tasks/coref.py survived the suite:
    the bundled SmolLM2 tokenizer adds no BOS, so it is only visible with a tokenizer that does, e.g. Llama's)."""
    bos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    tok = BosTokenizer(tokenizer, bos)
    raw = get_task("coref").make_samples(tok, 1024, 2, seed=0)
    assert all(s.tokens[0] == bos for s in raw)  # the shim works: raw prompts start with BOS
    for s in get_task("coref").make_samples(tok, 1024, 2, seed=0, chat=True):
        assert len(s.tokens) == 1024
        assert bos not in s.tokens  # no BOS inside the chat turn


def test_cwe_items_are_interleaved(tokenizer):
    """cwe's numbered list interleaves the words (a seeded shuffle), so the ten common words are not ten runs of
    repeats (mutation `order = rng.permutation(len(items_list))` -> `range(len(items_list))` in eval/tasks/cwe.py
    survived the suite: the prompt then lists every word's copies back to back, a far easier task)."""
    for s in get_task("cwe").make_samples(tokenizer, 2048, 2, seed=0):
        text = tokenizer.decode(list(s.tokens))
        items = re.findall(r"^\s*(\d+)\. *(.+?)\s*$", text, flags=re.M)
        assert [int(i) for i, _ in items] == list(range(1, len(items) + 1))
        words = [w for _, w in items]
        counts = Counter(words)
        assert all(counts[a] == max(counts.values()) for a in s.answers)
        repeats = sum(a == b for a, b in zip(words, words[1:]))
        runs_if_sorted = sum(c - 1 for c in counts.values())
        assert runs_if_sorted >= 20
        assert repeats < runs_if_sorted / 4, (repeats, runs_if_sorted)
        first = words[:10]  # the first items are not all one common word
        assert len(set(first)) > 3
