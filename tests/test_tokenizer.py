"""The bundled GGUF's tokenizer built from its metadata (`models.tokenizer`, no torch) tokenizes, decodes and applies
the chat template exactly as transformers' own GGUF tokenizer (which needs torch and accelerate: the test extra)."""

from __future__ import annotations

from pathlib import Path

import pytest

from models.bundled import resolve_model
from models.gguf_loader import open_gguf
from models.tokenizer import PRE_TOKENIZERS, _field, gguf_tokenizer

TEXT = Path(__file__).parent / "data" / "austen_pride_and_prejudice_ch1-2.txt"
SAMPLES = [
    "The pass key is 12345. Remember it. 12345 is the pass key.\n\nWhat is the pass key? The pass key is",
    "Numbers: 3.14159, 2024-11-24, $1,000,000 and 007; x=42+17",
    "Unicode: héllo wörld, naïve café, 東京, Москва, emoji 😀👍🏽, tabs\tand\r\nnewlines   trailing  ",
    "Special tokens inside text: <|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "  leading spaces, don't, won't, I'm, we'll, they've, it's, O'Neil's",
    "",
]


@pytest.fixture(scope="module")
def ours():
    path = resolve_model("smollm2").path
    return gguf_tokenizer(open_gguf(path), path)


@pytest.fixture(scope="module")
def tokenizers_pair(ours):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    pytest.importorskip("accelerate")
    path = resolve_model("smollm2").path
    theirs = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return ours, theirs


def test_encode_decode_match_transformers(tokenizers_pair):
    ours, theirs = tokenizers_pair
    for text in SAMPLES + [TEXT.read_text()]:
        ids = ours(text)["input_ids"]
        assert ids == theirs(text)["input_ids"], text[:80]
        assert ours.decode(ids) == theirs.decode(ids) == text
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
    assert len(ours) == len(theirs) == 49152


def test_special_tokens_and_chat_template_match_transformers(tokenizers_pair):
    """The special tokens are the GGUF's own ids (bos 1, eos 2, unk 0, pad 2); transformers' GGUF loader agrees from
    5.25 on. Its 5.17 (on the GPU host, 2026-12-04) made eos "<|im_start|>", against the file's id 2 "<|im_end|>": there
    only the chat template and the ids are compared with it."""
    import transformers
    from packaging.version import Version

    ours, theirs = tokenizers_pair
    reader = open_gguf(resolve_model("smollm2").path)
    for name, token in (("bos", "<|im_start|>"), ("eos", "<|im_end|>"), ("unk", "<|endoftext|>"), ("pad", "<|im_end|>")):
        key = "unknown" if name == "unk" else "padding" if name == "pad" else name
        field = reader.fields[f"tokenizer.ggml.{key}_token_id"]
        file_id = int(field.parts[field.data[0]][0])
        assert (getattr(ours, f"{name}_token"), getattr(ours, f"{name}_token_id")) == (token, file_id), name
        if Version(transformers.__version__) >= Version("5.25"):
            assert getattr(theirs, f"{name}_token") == token and getattr(theirs, f"{name}_token_id") == file_id, name
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    text = ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nWhat is the capital" in text
    ids = ours(text, add_special_tokens=False)["input_ids"]
    assert ids == theirs(text, add_special_tokens=False)["input_ids"]
    assert ids.count(1) == 3 and ids.count(2) == 2  # <|im_start|> x3, <|im_end|> x2: kept whole


def test_digits_are_split_one_by_one(ours):
    """SmolLM's pre-tokenizer ("smollm") puts every digit on its own, as the model was trained."""
    pieces = ours.convert_ids_to_tokens(ours("in 1987 and 42")["input_ids"])
    assert pieces == ["in", "Ġ", "1", "9", "8", "7", "Ġand", "Ġ", "4", "2"], pieces


def test_unknown_pre_tokenizer_is_named():
    from models import tokenizer as tk

    with pytest.raises(ValueError, match="'mystery-pre'.*expected one of"):
        tk._pre_tokenizer("mystery-pre", "x.gguf")
    assert "smollm" in PRE_TOKENIZERS and "llama-bpe" in PRE_TOKENIZERS and "qwen2" in PRE_TOKENIZERS


def _tokenizer_gguf(path, pre, extra=None, more_tokens=(), more_types=()):
    """A GGUF holding only byte-level BPE tokenizer metadata: every byte's symbol, the merge "a b" and the whole
    token "abc" that no merge makes, then `more_tokens` of token types `more_types` (after the normal ones);
    extra(writer): more metadata."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = ["<|end|>", "<|eot|>"] + list(bytes_to_unicode().values()) + ["ab", "abc", *more_tokens]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3, 3] + [1] * (len(tokens) - 2 - len(more_types)) + list(more_types))
    w.add_token_merges(["a b"])
    w.add_eos_token_id(0)
    if extra is not None:
        extra(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return open_gguf(path)


def test_llama3_pre_tokenizers_take_whole_vocabulary_pieces_and_bos(tmp_path):
    """llama.cpp and Llama 3's tokenizer.json (`ignore_merges`): a piece in the vocabulary is one token even when
    no merge makes it; other pre-tokenizers run the merges. Llama 3's add BOS when the file does not say."""
    llama = gguf_tokenizer(_tokenizer_gguf(tmp_path / "l.gguf", "llama-bpe", lambda w: w.add_bos_token_id(0)),
                           tmp_path / "l.gguf")
    gpt2 = gguf_tokenizer(_tokenizer_gguf(tmp_path / "g.gguf", "gpt2", lambda w: w.add_bos_token_id(0)),
                          tmp_path / "g.gguf")
    assert llama.convert_ids_to_tokens(llama("abc", add_special_tokens=False)["input_ids"]) == ["abc"]
    assert gpt2.convert_ids_to_tokens(gpt2("abc", add_special_tokens=False)["input_ids"]) == ["ab", "c"]
    assert llama("abc")["input_ids"][0] == 0 and gpt2("abc")["input_ids"][0] != 0
    said = gguf_tokenizer(_tokenizer_gguf(tmp_path / "s.gguf", "llama-bpe", lambda w: (
        w.add_bos_token_id(0), w.add_add_bos_token(False))), tmp_path / "s.gguf")
    assert said("abc")["input_ids"][0] != 0  # the file's add_bos_token wins


def test_qwen2_pre_tokenizer_normalizes_nfc(tmp_path):
    decomposed, composed = "e\u0301", "\u00e9"
    qwen = gguf_tokenizer(_tokenizer_gguf(tmp_path / "q.gguf", "qwen2"), tmp_path / "q.gguf")
    gpt2 = gguf_tokenizer(_tokenizer_gguf(tmp_path / "g.gguf", "gpt2"), tmp_path / "g.gguf")
    assert qwen(decomposed)["input_ids"] == qwen(composed)["input_ids"] == gpt2(composed)["input_ids"]
    assert gpt2(decomposed)["input_ids"] != gpt2(composed)["input_ids"]


def test_end_of_turn_ids_stop_generation(tmp_path, monkeypatch):
    """A GGUF's eot / eom ids are stop ids beside EOS (llama.cpp's end-of-generation set), kept with the
    tokenizer's cache; ids outside the vocabulary are ignored."""
    from models import bundled
    from models.tokenizer import stop_token_ids

    path = tmp_path / "t.gguf"
    reader = _tokenizer_gguf(path, "gpt2", lambda w: (w.add_uint32("tokenizer.ggml.eot_token_id", 1),
                                                      w.add_uint32("tokenizer.ggml.eom_token_id", 10 ** 6)))
    assert stop_token_ids(reader) == (1,)
    assert stop_token_ids(_tokenizer_gguf(tmp_path / "n.gguf", "gpt2")) == ()
    eom = _tokenizer_gguf(tmp_path / "m.gguf", "gpt2", lambda w: (w.add_uint32("tokenizer.ggml.eot_token_id", 1),
                                                                  w.add_uint32("tokenizer.ggml.eom_token_id", 0)))
    assert stop_token_ids(eom) == (1, 0)
    monkeypatch.setenv("JSPARSE_CACHE", str(tmp_path / "cache"))
    built, stops = bundled._gguf_tokenizer(path)
    cached, again = bundled._gguf_tokenizer(path, open_reader=lambda: pytest.fail("the cache was not used"))
    assert stops == again == (1,) and cached("abc")["input_ids"] == built("abc")["input_ids"]


@pytest.mark.parametrize("pre,extra,bos,eos", [
    ("llama-bpe", lambda w: w.add_bos_token_id(0), True, False),  # Llama 3: BOS when the file does not say
    ("llama-bpe", lambda w: (w.add_bos_token_id(0), w.add_add_bos_token(False), w.add_add_eos_token(True)),
     False, True),
    ("gpt2", None, False, False)])
def test_the_cached_tokenizer_keeps_add_bos_and_add_eos(tmp_path, monkeypatch, pre, extra, bos, eos):
    """A save_pretrained folder reloads with add_bos_token / add_eos_token False whatever the tokenizer added: the
    cache keeps both flags beside the folder, so the second load reports what the first did (the ids were the
    same either way); a cache whose flags are not booleans is rebuilt with a warning."""
    import json

    from models import bundled

    path = tmp_path / "t.gguf"
    _tokenizer_gguf(path, pre, extra)
    monkeypatch.setenv("JSPARSE_CACHE", str(tmp_path / "cache"))
    built, _ = bundled._gguf_tokenizer(path)
    cached, _ = bundled._gguf_tokenizer(path, open_reader=lambda: pytest.fail("the cache was not used"))
    for tok in (built, cached):
        assert (tok.add_bos_token, tok.add_eos_token) == (bos, eos)
        ids = tok("abc")["input_ids"]
        assert (ids[0] == 0, ids[-1] == 0) == (bos, eos)
    (side,) = (tmp_path / "cache").glob("*/jsparse_tokenizer.json")
    side.write_text(json.dumps({"stop_ids": [], "add_bos_token": "yes", "add_eos_token": False}))
    with pytest.warns(UserWarning, match="rebuilding unreadable tokenizer cache.*'add_bos_token': bool"):
        again, _ = bundled._gguf_tokenizer(path)
    assert again.add_bos_token == bos


def test_a_tokenizer_cache_written_meanwhile_by_another_process_is_no_warning(tmp_path, monkeypatch):
    """Two processes that miss the cache at once (xdist workers) both build the tokenizer; the one whose rename finds
    the other's folder in place keeps its own tokenizer without a warning, and leaves no temporary folder."""
    import shutil
    import warnings

    from models import bundled

    path = tmp_path / "t.gguf"
    _tokenizer_gguf(path, "gpt2")
    monkeypatch.setenv("JSPARSE_CACHE", str(tmp_path / "cache"))
    first, _ = bundled._gguf_tokenizer(path)
    (target,) = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    shutil.move(target, tmp_path / "other")  # the other process's folder, not yet renamed into place

    def reader_meanwhile():  # called after the cache was missed: the other process's rename lands now
        shutil.move(tmp_path / "other", target)
        return open_gguf(path)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tok, stops = bundled._gguf_tokenizer(path, open_reader=reader_meanwhile)
    assert tok("abc")["input_ids"] == first("abc")["input_ids"] and stops == ()
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.is_dir()] == [target.name]


def test_every_control_token_is_one_special_token():
    """Every control token of the GGUF (type 3) encodes as its one id and is dropped by skip_special_tokens, not
    only those named bos/eos/unk/pad (which transformers registers anyway)."""
    path = resolve_model("smollm2").path
    reader = open_gguf(path)
    tok = gguf_tokenizer(reader, path)
    tokens, types = _field(reader, "tokenizer.ggml.tokens"), _field(reader, "tokenizer.ggml.token_type")
    control = [(i, t) for i, (t, ty) in enumerate(zip(tokens, types)) if ty == 3]
    assert len(control) > 4  # more than bos / eos / unk / pad
    for i, t in control:
        assert tok(f"a{t}b", add_special_tokens=False)["input_ids"][1:-1] == [i], t
        assert tok.decode([i], skip_special_tokens=True) == "", t


def test_user_defined_tokens_are_kept_whole_and_not_special(tmp_path):
    """tokenizer.ggml.token_type 4 (user-defined, e.g. Qwen2's <tool_call>) is one token wherever it occurs in the
    text, as llama.cpp reads it, and is not special (decode keeps it when skipping special tokens)."""
    path = tmp_path / "u.gguf"
    tok = gguf_tokenizer(_tokenizer_gguf(path, "gpt2", more_tokens=["<tool>"], more_types=[4]), path)
    ids = tok("x<tool>y", add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["x", "<tool>", "y"]
    assert ids[1] == len(tok) - 1
    assert tok.decode(ids, skip_special_tokens=True) == "x<tool>y"


def test_special_token_ids_outside_the_vocabulary_are_ignored(tmp_path):
    """A padding / unknown id past the vocabulary (files in the wild carry such ids) leaves that token unset."""
    path = tmp_path / "p.gguf"
    tok = gguf_tokenizer(_tokenizer_gguf(path, "gpt2", extra=lambda w: (w.add_pad_token_id(10 ** 6),
                                                                        w.add_unk_token_id(10 ** 6))), path)
    assert tok.pad_token is None and tok.unk_token is None
    assert (tok.eos_token, tok.eos_token_id) == ("<|end|>", 0)


def test_llama3_split_is_the_only_regex(tmp_path):
    """Llama 3's pre-tokenizer splits with its own regex only (tokenizer.json: ByteLevel use_regex=false): ".abc"
    stays one piece, which is not in the vocabulary, so the merges make ".", "ab", "c" (a second GPT-2 split would
    give the whole token "abc"); digits go in runs of up to three ("123" whole, then "4", "5"), where Qwen2's
    split takes each digit on its own."""
    llama, qwen = (gguf_tokenizer(_tokenizer_gguf(tmp_path / f"{pre}.gguf", pre, more_tokens=["123"]),
                                  tmp_path / f"{pre}.gguf") for pre in ("llama-bpe", "qwen2"))

    def pieces(tok, text):
        return tok.convert_ids_to_tokens(tok(text, add_special_tokens=False)["input_ids"])

    assert pieces(llama, ".abc") == [".", "ab", "c"]
    assert pieces(llama, "12345") == ["123", "4", "5"]
    assert pieces(qwen, "12345") == ["1", "2", "3", "4", "5"]
