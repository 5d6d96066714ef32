"""The generated tasks (eval/tasks/): every registered task at two lengths with the bundled tokenizer (no model
forward): the answers sit in the prompt exactly where they should, lengths hit the request within 1%, the seed
reproduces the prompt and another seed changes it, both haystacks and chat mode work; the metrics on
hand-made predictions; errors name the bad value."""

from __future__ import annotations

import re
from collections import Counter

import numpy as np
import pytest

from eval import tasks as tasks_pkg
from eval.tasks import TASKS, Sample, get_task, score, string_match_all, string_match_part
from eval.tasks import common
from eval.tasks import fwe as fwe_task
from eval.tasks import niah
from eval.ppl import DEV_CORPUS
from eval.tasks.words import NOUNS
from eval import coref as coref_prompts

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


def test_a_string_answer_is_one_answer_not_its_characters():
    """A bare string is one reference (mutation: dropping the `isinstance(answers, str)` branch of
    `_check_answers` scored "a" against "abc" as 1/3 and "b" as a hit for _part; test_metrics only used a
    prediction equal to the answer)."""
    assert string_match_all("a", "abc") == 0.0
    assert string_match_part("b c", "abc") == 0.0
    assert string_match_all("ABC!", "abc") == 1.0


def test_task_refuses_zero_new_tokens_and_max_prompt_allows_one_percent():
    """max_new_tokens >= 1 (mutation `< 1` -> `< 0` survived); a non-exact task's prompt may have
    int(length * 1.01) + 1 tokens (mutation dropping the + 1 survived)."""
    with pytest.raises(ValueError, match=r"max_new_tokens=0, expected >= 1"):
        tasks_pkg.Task(name="t", metric="string_match_all", max_new_tokens=0, make_samples=lambda: [], doc="d")
    loose = tasks_pkg.Task(name="t", metric="string_match_all", max_new_tokens=1, make_samples=lambda: [], doc="d",
                           exact_length=False)
    assert loose.max_prompt(1000) == 1011 and loose.max_prompt(100) == 102
    assert get_task("vt").max_prompt(1000) == 1000


def test_a_bool_sample_count_is_refused(tokenizer):
    """samples=True is not a count (mutation dropping the bool check of check_request survived)."""
    with pytest.raises(ValueError, match=r"samples=True, expected >= 1"):
        get_task("niah_single_number").make_samples(tokenizer, 512, True, 0)
    with pytest.raises(ValueError, match=r"length=True"):
        get_task("niah_single_number").make_samples(tokenizer, True, 1, 0)


def test_count_is_case_insensitive_and_counts_overlaps():
    """common.count's docstring: case-insensitive, overlapping occurrences too (mutations dropping the lower() and
    stepping past a whole match survived)."""
    assert common.count("Apple pie, APPLE tart", "apple") == 2
    assert common.count("aaaa", "aa") == 3
    assert common.count("1212121", "121") == 3
    assert common.count("nothing", "x") == 0


def test_numbers_have_seven_digits():
    """RULER's values are 7-digit numbers (mutation widening the range to 6-digit ones survived)."""
    rng = np.random.default_rng(0)
    values = [common.number(rng) for _ in range(500)]
    assert all(len(v) == 7 and v.isdigit() and v[0] != "0" for v in values)


def test_assemble_puts_a_needle_at_the_last_boundary_at_or_before_its_depth(tokenizer):
    """A needle goes at the last sentence boundary <= round(depth * F), the filler's end included (mutations
    `side="right"` -> `"left"`, dropping the `- 1`, and `b <= n` -> `b < n` in common.py survived: the depth test
    allows 3%)."""
    needle = common.ids(tokenizer, " One of the special magic numbers for x is: 1234567.")
    _, bounds = common.filler(tokenizer, "repeat", 400, np.random.default_rng(0))
    n = max(b for b in bounds if b <= 400)  # a filler that ends on a sentence boundary
    tokens, bounds = common.filler(tokenizer, "repeat", n, np.random.default_rng(0))
    assert bounds[-1] == n
    cases = [0.0, 1.0] + [b / n for b in bounds[1:6]] + [(b + 1) / n for b in bounds[1:6]] + [0.37, 0.5, 0.93]
    for depth in cases:
        out = common.assemble(tokenizer, "t", n + len(needle), [], [], [(needle, depth)], "repeat",
                              np.random.default_rng(0))
        cut = max(b for b in bounds if b <= round(depth * n))
        assert out == tokens[:cut] + needle + tokens[cut:], (depth, cut)


def test_assemble_keeps_sixteen_filler_tokens(tokenizer):
    """min_filler defaults to 16 filler tokens (mutation 16 -> 0 survived)."""
    prefix, suffix = common.ids(tokenizer, "Head.\n"), common.ids(tokenizer, "\nTail?")
    fixed = len(prefix) + len(suffix)
    with pytest.raises(ValueError, match=rf"length={fixed + 15} is too short.*expected a length >= {fixed + 16}"):
        common.assemble(tokenizer, "t", fixed + 15, prefix, suffix, [], "repeat", np.random.default_rng(0))
    assert len(common.assemble(tokenizer, "t", fixed + 16, prefix, suffix, [], "repeat",
                               np.random.default_rng(0))) == fixed + 16


def test_corpus_filler_starts_and_breaks_after_sentence_ends(tokenizer):
    """A corpus filler starts at a sentence's start and its needle boundaries follow a sentence's last token
    (mutations dropping the `+ 1` of `starts` and of `bounds` in common.filler survived: a needle then went between
    a sentence and its full stop)."""
    corpus = common.corpus_tokens(tokenizer, "corpus")
    for seed in range(4):
        tokens, bounds = common.filler(tokenizer, "corpus", 300, np.random.default_rng(seed))
        starts = [int(s) for s in np.flatnonzero(corpus.ids == tokens[0]) if corpus.ids[s:s + 300].tolist() == tokens]
        assert starts, seed
        start = starts[0]
        assert start == 0 or corpus.ends[start - 1], seed
        assert bounds[0] == 0 and len(bounds) > 3
        assert all(corpus.ends[start + b - 1] for b in bounds[1:]), seed


def test_a_value_the_haystack_holds_is_redrawn(tokenizer, tmp_path):
    """A drawn value that the corpus haystack also holds is redrawn, so the answer occurs once (mutation `== c` ->
    `>= c` in common.retry survived: the shipped corpus rarely holds a 7-digit number or a drawn noun)."""
    story = tmp_path / "nouns.txt"
    half = NOUNS[::2]
    story.write_text(" ".join(f"The {w} slept." for w in half) + "\n\n" * 1 + " ".join(f"A {w} ran." for w in half))
    for s in get_task("niah_single_word").make_samples(tokenizer, 512, 10, 0, haystack=str(story)):
        text = _text(tokenizer, s)
        assert any(f" {w} " in text for w in half)  # the haystack's nouns are in the prompt
        (answer,) = s.answers
        assert common.count(text, answer) == 1, answer


def test_niah_query_joins_keys_as_ruler():
    """"a", "a and b", "a, b and c" (mutation joining every key with ", " survived)."""
    assert niah.query_text(["a"]) == "a"
    assert niah.query_text(["a", "b"]) == "a and b"
    assert niah.query_text(["a", "b", "c", "d"]) == "a, b, c and d"


@pytest.mark.parametrize("name,needles,asked,answers", [("niah_multikey", 4, 1, 1), ("niah_multiquery", 4, 4, 4),
                                                        ("niah_multivalue", 4, 1, 4)])
def test_niah_variants_have_their_needle_counts_and_no_depth(tokenizer, name, needles, asked, answers):
    """Multi-key: 4 needles, 1 key asked (3 distractors); multi-query: 4 keys asked; multi-value: 4 values of one key;
    the last two have Sample.depth None (mutations DISTRACTORS 3 -> 2, QUERIES 4 -> 3 and `single = queries == 1`
    survived)."""
    for s in get_task(name).make_samples(tokenizer, 512, 5, seed=0):
        text = _text(tokenizer, s)
        found = re.findall(r"One of the special magic numbers for ([\w-]+) is: (\d+)\.", text)
        query = re.search(r"special magic numbers for (.+?) mentioned in the provided text\?", text).group(1)
        keys = [k.strip() for k in re.split(r",| and ", query)]
        assert len(found) == needles and len(keys) == asked and len(s.answers) == answers
        assert len({k for k, _ in found}) == (4 if name != "niah_multivalue" else 1)
        if name != "niah_multikey":
            assert s.depth is None


def test_niah_chat_answer_prefix_opens_the_assistant_turn(tokenizer):
    """In chat mode the answer prefix follows the assistant header directly (mutation dropping `.lstrip()` in
    common.frame survived: a stray space opened the assistant's turn)."""
    for s in get_task("niah_single_number").make_samples(tokenizer, 512, 2, 0, chat=True):
        assert "<|im_start|>assistant\nThe special magic numbers for " in _text(tokenizer, s)


def test_cwe_words_occur_only_as_their_items(tokenizer, tmp_path):
    """A word of the list occurs nowhere else in the prompt (not in the instructions or the chat template), so a
    substring match scores only its own item (mutation dropping `word in self.avoid` in WordSource._ok survived:
    a haystack holding the instructions' words, "most", "often", "list", then put them in the list)."""
    instructions = ["below", "numbered", "list", "words", "appear", "often", "others", "memorize", "most", "common",
                    "question", "answer", "above", "system", "assistant", "user"]
    mixed = tmp_path / "mixed.txt"
    mixed.write_text(" ".join(list(NOUNS) + instructions * 5) + ".\n")
    for chat in (False, True):
        for s in get_task("cwe").make_samples(tokenizer, 2048, 3, 0, haystack=str(mixed), chat=chat):
            text = _text(tokenizer, s)
            items = Counter(re.findall(r"^\d+\. (\S+)$", text, flags=re.M))
            assert len(items) > 50
            bad = {w: (c, common.count(text, w)) for w, c in items.items() if common.count(text, w) != c}
            assert not bad, bad


def test_cwe_common_words_fill_about_half_the_list(tokenizer):
    """Each common word appears max(3, N // 20) times for about N items: the ten take about half the list (mutation
    N // 20 -> N // 40 survived)."""
    for length in (1024, 4096):
        for s in get_task("cwe").make_samples(tokenizer, length, 2, 0):
            items = re.findall(r"^\d+\. (\S+)$", _text(tokenizer, s), flags=re.M)
            counts = Counter(items)
            share = sum(counts[a] for a in s.answers) / len(items)
            assert 0.45 <= share <= 0.7, (length, share)


def test_cwe_refuses_uncommon_words_as_frequent_as_the_common_ones(tokenizer, tmp_path):
    """At 600 tokens with a 40-word pool the other words would need 5 copies each, as many as the ten answers: an
    error, not a list whose answers are not the most common (mutation `uncommon >= freq` -> `>` survived)."""
    few = tmp_path / "few40.txt"
    few.write_text(" ".join(NOUNS[:40]) + ".\n")
    assert len(common.corpus_words(tokenizer, str(few))) == 40
    with pytest.raises(ValueError, match=r"length=600 needs more distinct words than the 40 of the word pool"):
        get_task("cwe").make_samples(tokenizer, 600, 1, 0, haystack=str(few))


def test_fwe_counts_follow_zipf_and_take_85_percent(tokenizer):
    """The word of rank r appears floor(S / r^2) times (so count_r == count_1 // r^2) while that is >= 2, and these
    ranked words take RANKED_SHARE = 85% of the text's tokens (floors leave it a little under) (mutations ALPHA 2 ->
    1.5, RANKED_SHARE 0.85 -> 0.6 survived)."""
    for length in (1024, 4096):
        for s in get_task("fwe").make_samples(tokenizer, length, 2, 0):
            text = _text(tokenizer, s)
            body = text[text.index("coded words.\n") + len("coded words.\n"):text.index("\nQuestion:")]
            counts = Counter(body.split())
            ranked = [c for _, c in counts.most_common() if c >= 2]
            assert len(ranked) > 3 and ranked == [ranked[0] // r ** 2 for r in range(1, len(ranked) + 1)]
            cost = {w: len(common.ids(tokenizer, " " + w)) for w in counts}
            share = sum(c * cost[w] for w, c in counts.items() if c >= 2) / sum(c * cost[w] for w, c in counts.items())
            assert 0.8 <= share <= 0.86, (length, share)


def test_fwe_needs_a_fourth_rank_below_the_third():
    """Words of one token each: ranks join while floor(0.85 budget / sum_r 1/r^2 / r^2) >= 2. At a budget of 53 the
    fourth rank would get 0.85 * 53 / 1.4236 / 16 = 1.98 (no fourth rank: not enough to rank three words, None),
    at 54 it gets 2.02: counts floor(32.24 / r^2) = 32, 8, 3, 2 (with `< TOP` for `<= TOP` the three-rank case
    crashed on a missing fourth word instead of the task's "too short" error)."""
    class Words:  # common.WordSource's interface, one token per word
        def __init__(self):
            self.made, self.back = 0, []

        def take(self):
            if self.back:
                return self.back.pop()
            self.made += 1
            return f"w{self.made}"

        def give_back(self, w):
            self.back.append(w)

        def cost(self, w):
            return 1

    assert fwe_task._ranked_counts(Words(), 53) is None
    assert fwe_task._ranked_counts(Words(), 54) == {"w1": 32, "w2": 8, "w3": 3, "w4": 2}


def test_fwe_coded_words_have_three_to_six_letters():
    """RULER's coded words: 3-6 lowercase letters (mutation `integers(3, 7)` -> `(3, 6)` survived)."""
    rng = np.random.default_rng(0)
    words = [fwe_task.coded_word(rng) for _ in range(400)]
    assert {len(w) for w in words} == {3, 4, 5, 6} and all(w.isalpha() and w.islower() for w in words)


@pytest.mark.parametrize("name", ["niah_single_number", "vt", "cwe", "fwe", "passkey"])
def test_raw_prompts_start_with_bos_and_chat_turns_hold_none(tokenizer, name):
    """With a tokenizer that adds a BOS (Llama's), a raw prompt starts with it once and a chat prompt has none in the
    user's turn (mutations dropping special_prefix in common.frame, and `p.tokens[len(special):...]` ->
    `p.tokens[:...]` in eval/tasks/passkey.py, survived: the bundled SmolLM2 tokenizer adds no BOS)."""
    bos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    tok = BosTokenizer(tokenizer, bos)
    for s in get_task(name).make_samples(tok, 1024, 2, seed=0):
        assert len(s.tokens) == 1024 and s.tokens[0] == bos and s.tokens.count(bos) == 1
    for s in get_task(name).make_samples(tok, 1024, 2, seed=0, chat=True):
        assert len(s.tokens) == 1024 and bos not in s.tokens


def test_coref_prompt_span_question_and_distractor_spacing(tokenizer):
    """eval.coref.make_prompt: `span` covers exactly the location's tokens in INTRO, tokens[context_len:] is exactly the
    QUESTION, and the k-th of the 8 distractor facts starts at the first sentence boundary at or after k / 9 of the
    body (mutations `span_start + 1`, `context_len + 1` and `body // (facts + 8)` survived the suite)."""
    length = 1024
    for i in range(3):
        p = coref_prompts.make_prompt(tokenizer, length, np.random.default_rng([0, length, i]))
        assert len(p.tokens) == length and p.distractors == 8
        assert tokenizer.decode(p.tokens[p.span[0]:p.span[1]].tolist()) == " " + p.answer
        question = coref_prompts.QUESTION.format(name=p.name, object=p.object)
        assert tokenizer.decode(p.tokens[p.context_len:].tolist()) == question
        body_start, body_end = p.span[1] + len(coref_prompts._ids(tokenizer, ".")), p.context_len
        body = p.tokens[body_start:body_end].tolist()
        starts = []
        for m in re.finditer(r" (\w+) put the ([\w ]+?) in the (\w+)\.", tokenizer.decode(body)):
            fact = coref_prompts._ids(tokenizer, m.group(0))
            starts.append(next(j for j in range(len(body)) if body[j:j + len(fact)] == fact))
        step = len(body) // 9
        assert len(starts) == 8
        for k, s in enumerate(starts, 1):
            assert k * step <= s < k * step + 40, (k, s, step)  # a filler sentence is < 40 tokens


def test_coref_prompt_errors_name_the_value(tokenizer):
    """A length that leaves fewer than 64 body tokens is refused naming the shortest length, which works; zero samples
    are refused (mutations `body_tokens < 1` and `samples < 0` survived)."""
    with pytest.raises(ValueError, match=r"coref length=100 is too short: expected at least (\d+) tokens") as e:
        coref_prompts.make_prompt(tokenizer, 100, np.random.default_rng(0))
    shortest = int(re.search(r"at least (\d+)", str(e.value)).group(1))
    assert len(coref_prompts.make_prompt(tokenizer, shortest, np.random.default_rng(0)).tokens) == shortest
    with pytest.raises(ValueError, match=f"coref length={shortest - 1} is too short: expected at least {shortest} "):
        coref_prompts.make_prompt(tokenizer, shortest - 1, np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"samples=0: expected >= 1"):
        coref_prompts.make_prompts(tokenizer, 1024, 0)


def test_coref_is_correct_is_a_case_insensitive_prefix_match():
    """The answer is correct when the completion starts with the location, case-insensitive, after leading spaces."""
    assert coref_prompts.is_correct(" Attic, under the", "attic")
    assert coref_prompts.is_correct("  greenhouse.", "greenhouse")
    assert not coref_prompts.is_correct(" old attic", "attic")  # the location must come first
    assert not coref_prompts.is_correct(" cellar", "attic")


def test_coref_draws_every_name_object_and_location():
    """The target is drawn uniformly from each pool, its last entry included, and never among its distractors
    (mutation `rng.integers(len(pool) - 1)` in eval.coref._pick survived)."""
    for pool in (coref_prompts.NAMES, coref_prompts.OBJECTS, coref_prompts.LOCATIONS):
        picks = set()
        for seed in range(300):
            target, others = coref_prompts._pick(np.random.default_rng(seed), pool)
            assert sorted(others + [target]) == sorted(pool) and target not in others
            picks.add(target)
        assert picks == set(pool)


class _SentencePieceNewline:
    """A stand-in tokenizer whose "\\n" is two ids, a word-start piece then the newline byte (as Llama's
    SentencePiece gives ["▁", "<0x0A>"]); the bundled SmolLM2 tokenizer has "\\n" as one id."""

    def __call__(self, text, add_special_tokens=True):
        assert text == "\n" and not add_special_tokens, text
        return {"input_ids": [29871, 13]}


def test_close_word_list_pads_up_to_one_percent_with_newlines_and_refuses_more():
    """common.close_word_list's docstring: a gap of at most 1% of the length becomes blank lines (the newline id,
    not the word-start piece before it) between the list and the question; one token more is a ValueError naming
    the length, the shortfall and the hint (mutations `gap > 0.01 * length` -> `> 0.02 *` or `>= 0.01 *`, and
    `ids(tokenizer, "\\n")[-1:]` -> `[:1]` survived the suite: the real tasks' gaps stay far from the boundary and
    the bundled tokenizer's "\\n" is one id)."""
    tok, length = _SentencePieceNewline(), 200
    prefix, suffix = [1, 2, 3], [7, 8]

    def body(gap):
        return [5] * (length - gap - len(prefix) - len(suffix))

    tokens = common.close_word_list(tok, "cwe", prefix, body(2), suffix, 2, length, 40, "use a bigger corpus")
    assert tokens == tuple(prefix + body(2) + [13, 13] + suffix)
    assert common.close_word_list(tok, "cwe", prefix, body(0), suffix, 0, length, 40, "h") == tuple(
        prefix + body(0) + suffix)
    with pytest.raises(ValueError, match=r"task 'fwe': length=200: the word source ran out of distinct words after "
                                         r"40 \(3 tokens short\); use a bigger corpus or a shorter length"):
        common.close_word_list(tok, "fwe", prefix, body(3), suffix, 3, length, 40, "use a bigger corpus")
