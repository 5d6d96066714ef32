"""A GGUF file's tokenizer, built from its metadata with `tokenizers` (no torch, no accelerate).

A GGUF has no tokenizer.json; llama.cpp stores the tokenizer as metadata:

  tokenizer.ggml.model        "gpt2" for byte-level BPE (SmolLM2, Llama 3, Qwen2/3)
  tokenizer.ggml.pre          the pre-tokenizer (how text is split before the merges): "smollm", "llama-bpe", ...
  tokenizer.ggml.tokens       the vocabulary, str[V], already spelled in the byte-level alphabet
  tokenizer.ggml.merges       "a b" merge rules, best first
  tokenizer.ggml.token_type   int[V]: 1 normal, 3 control (special tokens such as <|im_start|>), 4 user-defined
  tokenizer.ggml.{bos,eos,unknown,padding}_token_id, add_bos_token, add_eos_token
  tokenizer.ggml.{eot,eom}_token_id   end of turn / message: generation stops there too (`stop_token_ids`)
  tokenizer.chat_template     the Jinja chat template

`gguf_tokenizer(reader)` builds a byte-level BPE from these (`tokenizers.models.BPE` with the merges, the
pre-tokenizer named by `tokenizer.ggml.pre` and what that name implies beside it (Llama 3: whole-piece vocabulary
tokens before the merges and BOS by default; Qwen2: NFC), a byte-level decoder, the control tokens as special added
tokens) and
wraps it as a `transformers.PreTrainedTokenizerFast` (encode, decode, `apply_chat_template`, `save_pretrained`).
Other tokenizer kinds (SentencePiece "llama" GGUFs of Llama 2 / Mistral) are read through transformers' own GGUF
path, which needs torch: without it the error says so.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

# Pre-tokenizers, as llama.cpp names them (tokenizer.ggml.pre) -> how text is split before the BPE merges.
# "gpt2": the GPT-2 regex of the byte-level pre-tokenizer itself; "digits": each digit on its own first (SmolLM,
# StarCoder), then the GPT-2 regex; otherwise a split regex, then byte-level without its own regex.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {
    "default": "gpt2", "gpt2": "gpt2",
    "smollm": "digits", "starcoder": "digits", "refact": "digits", "codeshell": "digits",
    "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# As llama.cpp (llama-vocab.cpp) and the models' own Hugging Face tokenizers read them:
# - Llama 3's pre-tokenizers: a piece that is itself in the vocabulary is one token, whatever the merges would make
#   of it (`ignore_merges`), and BOS is added when the file does not say (tokenizer.ggml.add_bos_token absent);
# - Qwen2's: text is NFC-normalized first (`Qwen2Tokenizer`'s normalizer).
_IGNORE_MERGES = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3"})
_NFC = frozenset({"qwen2"})
_CONTROL, _USER_DEFINED = 3, 4


def transformers_module():
    """`transformers`, imported without its advice that PyTorch is missing (jsparse runs on JAX and uses only its
    tokenizers, which need no torch): TRANSFORMERS_NO_ADVISORY_WARNINGS is set when torch is not installed and
    the variable is unset."""
    if importlib.util.find_spec("torch") is None:
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    import transformers

    return transformers


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _pre_tokenizer(pre: str, where: str):
    from tokenizers import Regex, pre_tokenizers

    kind = PRE_TOKENIZERS.get(pre)
    if kind is None:
        raise ValueError(f"{where}: tokenizer.ggml.pre={pre!r} is a pre-tokenizer this library does not build; "
                         f"expected one of {sorted(PRE_TOKENIZERS)}")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=kind in ("gpt2", "digits"))
    if kind == "gpt2":
        return byte_level
    if kind == "digits":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(kind), behavior="isolated"), byte_level])


def byte_level_bpe(reader, where: str = "GGUF") -> Any:
    """The `transformers.PreTrainedTokenizerFast` of a GGUF whose tokenizer.ggml.model is "gpt2".

    Args:
      reader: a `gguf.GGUFReader`.
      where: the file, for error messages.
    Raises:
      ValueError: the tokenizer metadata is missing or names a pre-tokenizer not in PRE_TOKENIZERS.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    tokens = _field(reader, "tokenizer.ggml.tokens")
    merges = _field(reader, "tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise ValueError(f"{where}: no tokenizer.ggml.tokens / tokenizer.ggml.merges metadata (a GGUF without a "
                         "tokenizer)")
    types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):  # zip would drop the types of the last tokens (control tokens split as text)
        raise ValueError(f"{where}: tokenizer.ggml.token_type has {len(types)} entries, but tokenizer.ggml.tokens "
                         f"has {len(tokens)}; expected one type per token")
    vocab = {t: i for i, t in enumerate(tokens)}
    # As llama.cpp splits a merge: at the first space after its first character.
    bad = next((m for m in merges if not isinstance(m, str) or m.find(" ", 1) < 0), None)
    if bad is not None:
        raise ValueError(f"{where}: tokenizer.ggml.merges holds {bad!r}: expected merges of two symbols, "
                         "'left right'")
    pairs = [(m[:m.find(" ", 1)], m[m.find(" ", 1) + 1:]) for m in merges]
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    try:
        bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False,
                         ignore_merges=pre in _IGNORE_MERGES)
    except Exception as e:  # tokenizers raises a bare Exception, e.g. for a merge of a symbol not in the vocabulary
        raise ValueError(f"{where}: the tokenizer metadata does not make a BPE tokenizer: {e}") from None
    tk = Tokenizer(bpe)
    tk.pre_tokenizer = _pre_tokenizer(pre, where)
    if pre in _NFC:
        tk.normalizer = normalizers.NFC()
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t, ty in zip(tokens, types) if ty == _CONTROL])
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
    if user:
        tk.add_tokens(user)

    def token(key: str):
        i = _field(reader, f"tokenizer.ggml.{key}_token_id")
        return None if i is None or not 0 <= int(i) < len(tokens) else tokens[int(i)]

    kwargs = {k: token(g) for k, g in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"),
                                        ("pad_token", "padding"))}
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    return transformers_module().PreTrainedTokenizerFast(
        tokenizer_object=tk, chat_template=_field(reader, "tokenizer.chat_template"),
        add_bos_token=bool(_field(reader, "tokenizer.ggml.add_bos_token", pre in _IGNORE_MERGES)),
        add_eos_token=bool(_field(reader, "tokenizer.ggml.add_eos_token", False)), **kwargs)


def stop_token_ids(reader) -> tuple[int, ...]:
    """The ids beside tokenizer.ggml.eos_token_id that end generation: the end-of-turn and end-of-message tokens the
    file names (tokenizer.ggml.eot_token_id, eom_token_id; an instruct Llama 3's <|eot_id|>), those in the
    vocabulary. llama.cpp also takes some control tokens as such by their text (<|eot_id|>, <|im_end|>, ...) when
    a file names none; this does not (an older file without the keys stops at its EOS only)."""
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    out = []
    for key in ("eot", "eom"):
        i = _field(reader, f"tokenizer.ggml.{key}_token_id")
        if i is not None and 0 <= int(i) < len(tokens) and int(i) not in out:
            out.append(int(i))
    return tuple(out)


def gguf_tokenizer(reader, path) -> Any:
    """The tokenizer of the GGUF at `path` (read by `reader`, a `gguf.GGUFReader`): byte-level BPE GGUFs are built
    here without torch; other kinds go through transformers' GGUF loader, which needs torch and accelerate. None
    when the file holds no tokenizer (no `tokenizer.ggml.model`): the model loads without one, as a Hugging Face
    folder without tokenizer files does, and takes token ids.

    Raises:
      ValueError: a tokenizer kind this module does not build and transformers cannot load here (named).
    """
    kind = _field(reader, "tokenizer.ggml.model")
    if kind is None:
        return None
    if kind == "gpt2":
        return byte_level_bpe(reader, where=str(path))
    try:
        import accelerate  # noqa: F401  (transformers loads GGUF only with it)
        import torch  # noqa: F401
    except ImportError as e:
        raise ValueError(f"{path}: tokenizer.ggml.model={kind!r}: this library builds only byte-level BPE ('gpt2') "
                         f"GGUF tokenizers itself; for {kind!r} it uses transformers' GGUF loader, which needs torch "
                         f"and accelerate ({e}): `pip install torch accelerate`, or load a Hugging Face folder with "
                         "its tokenizer files") from None
    try:
        return transformers_module().AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # transformers' messages do not name the file
        raise ValueError(f"{path}: tokenizer.ggml.model={kind!r}: transformers cannot build this GGUF's tokenizer: "
                         f"{type(e).__name__}: {e}") from e
