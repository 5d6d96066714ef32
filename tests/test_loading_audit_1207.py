"""Loading audit (2026-12-07): bad config values, GGUF metadata, tokenizer metadata, tensor dtypes and specs each end
in one error that names the value, before the weights are read; none loads a model with guessed numbers."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from test_convert import tiny_llama

from models import bundled
from models.config import ConfigError, ModelConfig
from models.convert import load_hf_folder
from models.gguf_loader import load_gguf, open_gguf
from models.tokenizer import gguf_tokenizer

V = gguf.GGUFValueType
BASE = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def _from_hf(**changes):
    return ModelConfig.from_hf({**BASE, **changes}, where="cfg.json")


@pytest.fixture(scope="module")
def llama_model():
    return tiny_llama()


# ----------------------------------------------------------------------------------------------- config.json


@pytest.mark.parametrize("changes,named", [
    (dict(num_attention_heads=0), "num_attention_heads=0"),  # was a ZeroDivisionError
    (dict(num_attention_heads="4"), "num_attention_heads='4'"),  # was a TypeError
    (dict(num_key_value_heads=0), "num_key_value_heads=0"),  # was read as num_attention_heads
    (dict(head_dim=0), "head_dim=0"),  # was read as hidden_size // num_attention_heads
    (dict(num_hidden_layers=True), "num_hidden_layers=True"),  # was one layer
])
def test_config_sizes_zero_text_or_bool_are_named(changes, named):
    with pytest.raises(ConfigError, match=rf"^cfg\.json: {named}: expected a positive integer"):
        _from_hf(**changes)


def test_hidden_size_not_a_multiple_of_the_heads():
    """Llama requires hidden_size = k * num_attention_heads (transformers' LlamaConfig refuses it); the others take
    an explicit head_dim, and without one the head size would be a floor, a guess: refused."""
    with pytest.raises(ConfigError, match=r"hidden_size=66 is not a multiple of num_attention_heads=4.*LlamaConfig"):
        _from_hf(hidden_size=66)
    with pytest.raises(ConfigError, match=r"hidden_size=66 is not a multiple.*LlamaConfig"):
        _from_hf(hidden_size=66, head_dim=16)
    with pytest.raises(ConfigError, match=r"hidden_size=66 is not a multiple of num_attention_heads=4.*head_dim"):
        _from_hf(model_type="mistral", hidden_size=66, sliding_window=None)
    assert _from_hf(model_type="qwen3", hidden_size=66, head_dim=16).head_dim == 16


@pytest.mark.parametrize("changes,named", [
    (dict(rope_theta=0), r"rope theta=0\.0: expected a positive finite number"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": -1.0}), r"rope theta=-1\.0: expected a positive"),
    (dict(rope_scaling={"type": "linear", "factor": 0}), r"rope factor=0\.0: expected a positive finite number"),
    (dict(rope_scaling={"type": "linear", "factor": -2}), r"rope factor=-2\.0: expected a positive"),
    (dict(rope_scaling={"type": "linear", "factor": "abc"}), r"rope factor='abc': expected a number"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0}),
     r"rope low_freq_factor=4\.0 and high_freq_factor=4\.0: llama3 scaling expects low_freq_factor < high_freq_factor"),
    (dict(rope_scaling=[1, 2]), r"rope_scaling=\[1, 2\]: expected a JSON object"),
])
def test_rope_values_giving_nan_or_infinite_frequencies_are_named(changes, named):
    """Each of these loaded before (a NaN or infinite RoPE, a division by zero in llama3's band) or failed with a
    bare TypeError / float() ValueError."""
    with pytest.raises(ConfigError, match=rf"^cfg\.json: {named}"):
        _from_hf(**changes)


@pytest.mark.parametrize("changes,named", [
    (dict(tie_word_embeddings="false"), "tie_word_embeddings='false'"),
    (dict(attention_bias="false"), "attention_bias='false'"),
    (dict(mlp_bias=1), "mlp_bias=1"),
    (dict(model_type="qwen2", sliding_window=16, use_sliding_window="no"), "use_sliding_window='no'"),
])
def test_boolean_flags_of_another_type_are_refused(changes, named):
    """bool("false") is True: a tied head, biases or windows were switched on by a string meaning the opposite."""
    with pytest.raises(ConfigError, match=rf"{named}: expected true or false"):
        _from_hf(**changes)
    assert _from_hf(tie_word_embeddings=None).tie_word_embeddings is False


@pytest.mark.parametrize("changes,named", [
    (dict(eos_token_id="</s>"), r"eos_token_ids=\('</s>',\)"),
    (dict(eos_token_id=[2, None]), r"eos_token_ids=\(2, None\)"),
    (dict(bos_token_id=True), r"bos_token_id=True"),
    (dict(bos_token_id=-5), r"bos_token_id=-5"),
])
def test_token_ids_that_are_not_ids_are_named(changes, named):
    """A string EOS never matches a generated id: generation ignored it silently."""
    with pytest.raises(ConfigError, match=rf"{named}: expected non-negative integer token ids"):
        _from_hf(**changes)


def test_qwen2_window_layers_of_the_wrong_kind_are_named():
    qwen = dict(model_type="qwen2", sliding_window=16, use_sliding_window=True)
    with pytest.raises(ConfigError, match=r"max_window_layers=-1: expected a non-negative number of layers"):
        _from_hf(**qwen, max_window_layers=-1)  # windowed every layer before
    with pytest.raises(ConfigError, match=r"layer_types='full': expected a list"):
        _from_hf(**qwen, layer_types="full")


def test_binary_config_json_is_named(tmp_path):
    (tmp_path / "config.json").write_bytes(b"\xff\xfe\x00\x81garbage")  # was a UnicodeDecodeError naming nothing
    with pytest.raises(ConfigError, match=r"config\.json.*not valid JSON"):
        load_hf_folder(tmp_path)
    with pytest.raises(ConfigError, match=r"config\.json.*not valid JSON"):
        bundled.load_model(str(tmp_path))


# ----------------------------------------------------------------------------------------------- weights


def test_integer_or_bool_tensor_is_refused_not_cast(llama_model, tmp_path):
    llama_model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    for dtype in (np.int64, np.bool_):
        tensors["model.norm.weight"] = np.ones(64, dtype)
        save_file(tensors, tmp_path / "model.safetensors")
        with pytest.raises(ValueError, match=rf"'model\.norm\.weight' has dtype {np.dtype(dtype)}: expected a "
                                             "floating-point tensor"):
            load_hf_folder(tmp_path)


def test_shard_index_with_a_shard_that_is_not_a_name(llama_model, tmp_path):
    llama_model.save_pretrained(tmp_path, max_shard_size="100KB")
    index = tmp_path / "model.safetensors.index.json"
    meta = json.loads(index.read_text())
    meta["weight_map"]["model.norm.weight"] = 5  # was a TypeError (PosixPath / int)
    index.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"index\.json: weight_map maps 'model\.norm\.weight' to 5: expected a "
                                         "shard file name"):
        load_hf_folder(tmp_path)


# ----------------------------------------------------------------------------------------------- specs, folders


def test_broken_tokenizer_files_are_named_before_the_weights(llama_model, tmp_path):
    llama_model.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not read")  # the tokenizer is named first
    (tmp_path / "tokenizer.json").write_text("{not json")  # was a bare JSONDecodeError
    with pytest.raises(ValueError, match=r"the tokenizer files \['tokenizer\.json'\] cannot be loaded: "
                                         "JSONDecodeError"):
        bundled.load_model(str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_attention_heads": 0}))
    with pytest.raises(ConfigError, match=r"config\.json: num_attention_heads=0"):  # config.json before both
        bundled.load_model(str(tmp_path))


def test_an_empty_spec_is_not_the_working_directory(llama_model, tmp_path, monkeypatch):
    llama_model.save_pretrained(tmp_path)
    monkeypatch.chdir(tmp_path)  # Path("") is ".": it resolved to this folder before
    for spec in ("", "  "):
        with pytest.raises(ValueError, match=rf"model {spec!r}: expected one of \['smollm2'\]"):
            bundled.resolve_model(spec)


# ----------------------------------------------------------------------------------------------- GGUF


def _meta_gguf(path, override=None, tokens=None, types=None, merges=("a b",), kind="gpt2"):
    """A llama GGUF of valid metadata (E=64, 4 heads, 2 KV heads, 2 layers, F=128) and a zero token_embd [256, 64]
    only, for errors met before the other tensors are read; override: {key: (value, GGUFValueType)} replacing or
    adding metadata; tokens: a tokenizer.ggml.tokens list (with `types`, `merges`, model `kind`)."""
    override = dict(override or {})
    w = gguf.GGUFWriter(str(path), "llama")
    base = {"llama.block_count": (2, V.UINT32), "llama.context_length": (512, V.UINT32),
            "llama.embedding_length": (64, V.UINT32), "llama.feed_forward_length": (128, V.UINT32),
            "llama.attention.head_count": (4, V.UINT32), "llama.attention.head_count_kv": (2, V.UINT32),
            "llama.rope.freq_base": (10000.0, V.FLOAT32), "llama.attention.layer_norm_rms_epsilon": (1e-5, V.FLOAT32)}
    for key, (value, vtype) in {**base, **override}.items():
        if vtype == V.ARRAY:
            w.add_array(key, value)
        else:
            w.add_key_value(key, value, vtype)
    if tokens is not None:
        w.add_tokenizer_model(kind)
        w.add_tokenizer_pre("gpt2")
        w.add_token_list(tokens)
        if types is not None:
            w.add_token_types(types)
        w.add_token_merges(list(merges))
    w.add_tensor("token_embd.weight", np.zeros((256, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("key,value,vtype,named", [
    ("llama.attention.head_count", 0, V.UINT32, "head_count=0: expected a positive integer"),  # ZeroDivisionError
    ("llama.block_count", "two", V.STRING, "block_count='two': expected a positive integer"),  # bare int() error
    ("llama.attention.head_count_kv", [2, 2], V.ARRAY, r"head_count_kv=\[2, 2\]: expected a positive integer"),
    ("llama.attention.key_length", 0, V.UINT32, "key_length=0: expected a positive integer"),  # was E / heads
    ("llama.context_length", 0, V.UINT32, "context_length=0: expected a positive integer"),  # named no file
    ("llama.rope.freq_base", -5.0, V.FLOAT32, r"freq_base=-5\.0: expected a positive finite number"),  # loaded
    ("llama.rope.freq_base", "big", V.STRING, r"freq_base='big': expected a number"),
    ("llama.attention.layer_norm_rms_epsilon", 0.0, V.FLOAT32, r"GGUF metadata gives rms_norm_eps=0\.0"),
])
def test_gguf_metadata_values_are_named_with_the_file(tmp_path, key, value, vtype, named):
    path = _meta_gguf(tmp_path / "bad.gguf", {key: (value, vtype)})
    with pytest.raises(ValueError, match=rf"bad\.gguf: .*{named}"):
        load_gguf(path)


def test_gguf_token_list_unlike_the_embedding_is_refused(tmp_path):
    """258 tokens over a 256-row embedding: ids 256 and 257 read the last row (JAX clamps a gather) and the model
    loaded; llama.cpp refuses the file."""
    path = _meta_gguf(tmp_path / "vocab.gguf", tokens=[f"t{i}" for i in range(258)])
    with pytest.raises(ValueError, match=r"vocab\.gguf: tokenizer\.ggml\.tokens holds 258 tokens, but "
                                         r"token_embd\.weight has 256 rows"):
        load_gguf(path)


def _tokens():
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return ["<|end|>"] + list(bytes_to_unicode().values())[:253] + ["ab", "abc"]  # 256 tokens


@pytest.mark.parametrize("types,merges,named", [
    ([3, 1], ("a b",), r"token_type has 2 entries, but tokenizer\.ggml\.tokens has 256"),  # zip dropped the rest
    (None, ("ab",), r"merges holds 'ab': expected merges of two symbols"),  # was a TypeError from tokenizers
    (None, ("a zz",), r"does not make a BPE tokenizer: .*zz"),  # was a bare Exception naming no file
])
def test_gguf_tokenizer_metadata_malformed_is_named(tmp_path, types, merges, named):
    path = _meta_gguf(tmp_path / "tok.gguf", tokens=_tokens(), types=types, merges=merges)
    with pytest.raises(ValueError, match=rf"tok\.gguf: .*{named}"):
        gguf_tokenizer(open_gguf(path), path)


def test_gguf_tokenizer_kind_transformers_cannot_build_names_the_file(tmp_path):
    path = _meta_gguf(tmp_path / "kind.gguf", tokens=_tokens(), kind="bpe")
    with pytest.raises(ValueError, match=r"kind\.gguf: tokenizer\.ggml\.model='bpe'"):
        gguf_tokenizer(open_gguf(path), path)
