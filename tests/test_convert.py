"""Converter errors (each one named) and GGUF round trips through a tiny GGUF written with gguf.GGUFWriter."""

from __future__ import annotations

import json
import os
import shutil

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

from models import bundled
from models.bundled import load_gguf_cached, params_cache_path
from models.config import ConfigError, RopeConfig
from models.convert import from_transformers, load_hf_folder
from models.gguf_loader import load_gguf, permute_qk, unpermute_qk

transformers.utils.logging.disable_progress_bar()

VOCAB = 256


def tiny_llama(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, bos_token_id=None,
        eos_token_id=None, pad_token_id=None, **overrides)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def llama_model():
    return tiny_llama()


@pytest.fixture()
def folder(llama_model, tmp_path):
    llama_model.save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


def _edit_config(folder, **changes):
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


# ----------------------------------------------------------------------------------------------- HF errors


def test_unknown_architecture_is_named(folder):
    _edit_config(folder, model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"])
    with pytest.raises(ConfigError, match="gpt_neox"):
        load_hf_folder(folder)


def test_activation_other_than_silu_is_named(folder):
    """The decoder implements the SwiGLU MLP only: another `hidden_act` would give wrong logits, so it is refused."""
    _edit_config(folder, hidden_act="gelu")
    with pytest.raises(ConfigError, match="hidden_act='gelu'.*'silu'"):
        load_hf_folder(folder)


def test_missing_weight_file_is_named(folder):
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_hf_folder(folder)


def test_missing_shard_is_named(llama_model, tmp_path):
    llama_model.save_pretrained(tmp_path, max_shard_size="100KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    with pytest.raises(FileNotFoundError, match=shards[-1].name):
        load_hf_folder(tmp_path)


def test_missing_folder_and_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_hf_folder(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_folder(tmp_path)


def test_shape_disagreeing_with_config_is_named(folder):
    _edit_config(folder, intermediate_size=96)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.(gate|up|down)_proj\.weight.*shape.*96"):
        load_hf_folder(folder)


def test_kv_heads_disagreeing_with_config_is_named(folder):
    _edit_config(folder, num_key_value_heads=4)
    with pytest.raises(ValueError, match=r"self_attn\.[kv]_proj\.weight' has shape \(32, 64\).*\(64, 64\)"):
        load_hf_folder(folder)


def test_missing_tensor_is_named(folder):
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight.*missing"):
        load_hf_folder(folder)


def test_unknown_tensor_is_named(folder):
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.self_attn.rel_pos.weight"] = np.zeros((4,), np.float32)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"rel_pos"):
        load_hf_folder(folder)


def test_corrupt_safetensors_is_named(folder):
    (folder / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ValueError, match="model.safetensors"):
        load_hf_folder(folder)


def test_tied_config_with_a_different_stored_head_is_refused(llama_model, tmp_path):
    """tie_word_embeddings=true makes the model use its embedding as head: a stored copy of it loads, a stored head
    that differs would have been dropped silently (logits unlike transformers'), so it is refused by name."""
    tied = tiny_llama(seed=2, tie_word_embeddings=False)
    tensors = {k: v.detach().numpy().copy() for k, v in tied.state_dict().items()}
    tied.save_pretrained(tmp_path / "differs")
    _edit_config(tmp_path / "differs", tie_word_embeddings=True)
    with pytest.raises(ValueError, match=r"tie_word_embeddings=true.*stores a different 'lm_head.weight' "
                                         r"\(max \|difference\| .*set tie_word_embeddings to false"):
        load_hf_folder(tmp_path / "differs")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    shutil.copytree(tmp_path / "differs", tmp_path / "copy")
    save_file(tensors, tmp_path / "copy" / "model.safetensors", metadata={"format": "pt"})
    cfg, params = load_hf_folder(tmp_path / "copy")
    assert cfg.tie_word_embeddings and params.lm_head is None


@pytest.mark.parametrize("field,value", [("max_position_embeddings", None), ("rms_norm_eps", None),
                                         ("rms_norm_eps", 0), ("max_position_embeddings", 0)])
def test_config_scalars_null_or_out_of_range_are_named(folder, field, value):
    _edit_config(folder, **{field: value})
    with pytest.raises(ConfigError, match=rf"{field}={value!r}: expected a positive"):
        load_hf_folder(folder)


def test_broken_shard_index_is_named(llama_model, tmp_path):
    llama_model.save_pretrained(tmp_path, max_shard_size="100KB")
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(index.read_text()[:40])
    with pytest.raises(ValueError, match=r"index.json: not valid JSON"):
        load_hf_folder(tmp_path)
    index.write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"index.json holds a list: expected a JSON object with a 'weight_map'"):
        load_hf_folder(tmp_path)


# ----------------------------------------------------------------------------------------------- GGUF


def write_gguf(model, path, qtype=gguf.GGMLQuantizationType.F32, arch=None, n_rot=None, extra=None):
    """Writes `model` (tiny HF Llama or Qwen3) as llama.cpp's convert_hf_to_gguf.py would: renamed, and for
    Llama the Q/K rows permuted (llama.cpp runs Qwen with NEOX RoPE, unpermuted). n_rot: rope.dimension_count
    (default the head size); extra(writer): more metadata."""
    c = model.config
    arch = arch or c.model_type
    permute = c.model_type == "llama"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(n_rot or getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    if extra is not None:
        extra(w)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    if c.model_type == "qwen3":
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                 "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue  # llama.cpp writes no output.weight for a tied head
        x = t.detach().float().numpy()
        if name in names:
            gname = names[name]
        else:
            parts = name.split(".")  # model.layers.{i}.{module...}.weight
            gname = f"blk.{parts[2]}.{per_layer['.'.join(parts[3:-1])]}.{parts[-1]}"
        if permute and name.endswith("q_proj.weight"):
            x = permute_qk(x, c.num_attention_heads)
        elif permute and name.endswith("k_proj.weight"):
            x = permute_qk(x, c.num_key_value_heads)
        if x.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(gname, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, np.ascontiguousarray(x, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _assert_trees_close(a, b, atol=0.0):
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=atol)


def test_permutation_round_trip():
    w = np.arange(4 * 16 * 3, dtype=np.float32).reshape(4 * 16, 3)
    p = permute_qk(w, 4)
    assert not np.array_equal(p, w)
    np.testing.assert_array_equal(unpermute_qk(p, 4), w)
    # llama.cpp's layout interleaves the two rotate-half partners: rows (i, i + D/2) become (2i, 2i + 1).
    np.testing.assert_array_equal(p[1], w[8])


def test_gguf_f32_loads_equal_to_hf_folder(llama_model, folder, tmp_path, parity):
    path = write_gguf(llama_model, tmp_path / "tiny.gguf")
    cfg_g, params_g = load_gguf(path)
    cfg_h, params_h = load_hf_folder(folder)
    assert cfg_g.num_layers == cfg_h.num_layers and cfg_g.head_dim == cfg_h.head_dim
    assert cfg_g.vocab_size == VOCAB and not cfg_g.tie_word_embeddings
    assert cfg_g.rope == cfg_h.rope and cfg_g.rms_norm_eps == pytest.approx(cfg_h.rms_norm_eps)
    _assert_trees_close(params_g, params_h)
    # transformers' own GGUF loader agrees: it undoes the same permutation.
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.float32)
    tokens = np.random.RandomState(0).randint(0, VOCAB, (1, 200))
    with torch.no_grad():
        ref = llama_model(torch.as_tensor(tokens)).logits.numpy()
        ref_gguf = hf(torch.as_tensor(tokens)).logits.numpy()
    ours = parity.logits(cfg_g, params_g, tokens)
    assert parity.compare(ours, ref)[0] <= 1e-4
    assert parity.compare(ref_gguf, ref)[0] <= 1e-4


def test_gguf_qwen3_loads_equal_to_hf_folder(tmp_path, parity):
    torch.manual_seed(5)
    config = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=128, max_position_embeddings=512, initializer_range=0.1,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "hf")
    path = write_gguf(model, tmp_path / "qwen3.gguf")
    cfg_g, params_g = load_gguf(path)
    cfg_h, params_h = load_hf_folder(tmp_path / "hf")
    # head_dim (128) is not hidden / heads (16): it must come from qwen3.attention.key_length.
    assert cfg_g.architecture == "qwen3" and cfg_g.qk_norm and cfg_g.head_dim == 128
    _assert_trees_close(params_g, params_h)
    # transformers reads no head_dim from a Qwen3 GGUF (its default, 128, is what real Qwen3 models use).
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    _assert_trees_close(from_transformers(hf)[1], params_h)


def test_gguf_without_unpermute_would_differ(llama_model, tmp_path):
    """The permutation matters: the GGUF's raw Q rows are not HF's (so the test above can fail)."""
    path = write_gguf(llama_model, tmp_path / "tiny.gguf")
    reader = gguf.GGUFReader(str(path))
    raw_q = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight").data
    hf_q = llama_model.model.layers[0].self_attn.q_proj.weight.detach().numpy()
    assert not np.allclose(raw_q, hf_q)
    np.testing.assert_array_equal(unpermute_qk(np.asarray(raw_q), 4), hf_q)


def test_gguf_q8_0_matches_transformers_gguf_load(llama_model, tmp_path):
    tied = tiny_llama(seed=1, tie_word_embeddings=True)
    path = write_gguf(tied, tmp_path / "tiny-q8.gguf", qtype=gguf.GGMLQuantizationType.Q8_0)
    cfg, params = load_gguf(path)
    assert cfg.tie_word_embeddings and params.lm_head is None
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    cfg_t, params_t = from_transformers(hf)
    _assert_trees_close(params, params_t)  # identical dequantization, identical un-permutation
    # ...and within Q8_0 rounding of the original weights.
    _, params_orig = from_transformers(tied)
    _assert_trees_close(params, params_orig, atol=0.02)


def test_gguf_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="absent.gguf"):
        load_gguf(tmp_path / "absent.gguf")


def test_gguf_garbage_is_named(tmp_path):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"this is not a gguf file at all" * 50)
    with pytest.raises(ValueError, match="garbage.gguf"):
        load_gguf(path)


@pytest.mark.parametrize("keep", [0.3, 0.9, 0.999])
def test_gguf_truncated_is_named(llama_model, tmp_path, keep):
    path = write_gguf(llama_model, tmp_path / "whole.gguf")
    data = path.read_bytes()
    cut = tmp_path / "truncated.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ValueError, match="truncated.gguf"):
        load_gguf(cut)


def test_gguf_without_a_tokenizer_loads_without_one(llama_model, tmp_path, monkeypatch):
    """A GGUF with no tokenizer.ggml.model loads as a Hugging Face folder without tokenizer files does: tokenizer
    None (it takes token ids), where it failed inside transformers' GGUF loader."""
    monkeypatch.setenv(bundled.CACHE_ENV, str(tmp_path / "cache"))
    path = write_gguf(llama_model, tmp_path / "no-tokenizer.gguf")
    model = bundled.load_model(str(path))
    assert model.tokenizer is None and model.cfg.num_layers == 2


def test_gguf_tensor_type_the_gguf_package_cannot_read_is_named():
    from models.gguf_loader import dequantize

    class Tensor:
        name, tensor_type = "output_norm.weight", gguf.GGMLQuantizationType.F64
        data, shape = np.zeros(4, np.float64), np.array([4])

    with pytest.raises(ValueError, match=r"'output_norm.weight' has type F64, which the gguf package cannot "
                                         r"dequantize"):
        dequantize(Tensor(), "x.gguf")


def test_gguf_rope_keys_read_as_llama_cpp_reads_them(llama_model, tmp_path):
    """A linear RoPE factor without rope.scaling.type (llama.cpp's default type), or under the older key
    rope.scale_linear, scales (it was dropped); a factor of 1 scales nothing; rope.dimension_count below the head
    size (a partial rotation this model does not do) is refused, not ignored."""
    def rope_of(name, fn):
        return load_gguf(write_gguf(llama_model, tmp_path / name, extra=fn))[0].rope

    for name, fn in (("factor.gguf", lambda w: w.add_rope_scaling_factor(4.0)),
                     ("old_key.gguf", lambda w: w.add_float32("llama.rope.scale_linear", 4.0)),
                     ("typed.gguf", lambda w: (w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR),
                                               w.add_rope_scaling_factor(4.0)))):
        rope = rope_of(name, fn)
        assert (rope.rope_type, rope.factor) == ("linear", 4.0), name
    assert rope_of("one.gguf", lambda w: w.add_rope_scaling_factor(1.0)).rope_type == "default"
    head = llama_model.config.hidden_size // llama_model.config.num_attention_heads
    with pytest.raises(ConfigError, match=rf"llama.rope.dimension_count={head // 2}: this model rotates every "
                                          rf"dimension of a head; expected head_dim={head}"):
        load_gguf(write_gguf(llama_model, tmp_path / "partial.gguf", n_rot=head // 2))


def test_gguf_explicit_rope_scaling_type_read_as_llama_cpp_reads_it(llama_model, tmp_path):
    """An explicit rope.scaling.type: "linear" with a factor of 1 or 0 scales nothing (plain RoPE, not linear x1);
    "linear" without a factor is an error; "none" never scales, whatever the factor (llama.cpp: never scale if
    the type is none); any other type (yarn) is refused. Mutants of each of these survived the key test above."""
    linear, none = gguf.RopeScalingType.LINEAR, gguf.RopeScalingType.NONE

    def rope_of(name, scaling, factor=None):
        def extra(w):
            w.add_rope_scaling_type(scaling)
            if factor is not None:
                w.add_rope_scaling_factor(factor)
        return load_gguf(write_gguf(llama_model, tmp_path / name, extra=extra))[0].rope

    plain = RopeConfig(theta=10000.0)
    assert rope_of("one.gguf", linear, 1.0) == plain
    assert rope_of("zero.gguf", linear, 0.0) == plain
    assert rope_of("none.gguf", none, 4.0) == plain
    with pytest.raises(ValueError, match=r"GGUF metadata key llama.rope.scaling.factor is missing \(rope scaling "
                                         r"type 'linear'\)"):
        rope_of("no_factor.gguf", linear)
    with pytest.raises(ConfigError, match=r"llama.rope.scaling.type='yarn' is not supported; expected 'none' or "
                                          r"'linear'"):
        rope_of("yarn.gguf", gguf.RopeScalingType.YARN, 4.0)


def test_gguf_unknown_architecture_is_named(llama_model, tmp_path):
    path = write_gguf(llama_model, tmp_path / "falcon.gguf", arch="falcon")
    with pytest.raises(ConfigError, match="falcon"):
        load_gguf(path)


# ----------------------------------------------------------------------------------------------- GGUF cache


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gguf_cache_hit_and_corrupt_entry_rebuilt(llama_model, tmp_path, monkeypatch, dtype):
    monkeypatch.setenv(bundled.CACHE_ENV, str(tmp_path / "cache"))
    path = write_gguf(llama_model, tmp_path / "tiny.gguf", qtype=gguf.GGMLQuantizationType.Q8_0)
    cfg, params, hit = load_gguf_cached(path, dtype)
    assert not hit and params.embed.dtype == dtype
    target = params_cache_path(path, dtype)
    assert target.is_file() and target.parent == tmp_path / "cache"
    cfg2, params2, hit2 = load_gguf_cached(path, dtype)
    assert hit2 and cfg2 == cfg
    _assert_trees_close(params2, params)

    size = target.stat().st_size
    target.write_bytes(target.read_bytes()[: size // 2])  # a truncated entry
    with pytest.warns(UserWarning, match="rebuilding"):
        cfg3, params3, hit3 = load_gguf_cached(path, dtype)
    assert not hit3 and cfg3 == cfg and target.stat().st_size == size
    _assert_trees_close(params3, params)
    target.write_bytes(b"not a safetensors file")  # a garbage entry
    with pytest.warns(UserWarning, match="rebuilding"):
        assert not load_gguf_cached(path, dtype)[2]
    assert load_gguf_cached(path, dtype)[2]

    # The key is the file's content, not its path or mtime: a copy elsewhere (or a touched file) hits the same
    # entry, converting nothing; a GGUF whose bytes changed has another key, so a stale entry is never read.
    copy = tmp_path / "elsewhere" / "tiny.gguf"
    copy.parent.mkdir()
    shutil.copy(path, copy)
    assert params_cache_path(copy, dtype) == target
    with monkeypatch.context() as mp:
        mp.setattr(bundled, "load_gguf", lambda *a, **k: pytest.fail("a copy of a cached GGUF was converted again"))
        assert load_gguf_cached(copy, dtype)[2]
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert params_cache_path(path, dtype) == target
    changed = write_gguf(llama_model, tmp_path / "elsewhere" / "changed.gguf", qtype=gguf.GGMLQuantizationType.Q4_0)
    assert params_cache_path(changed, dtype) != target
    assert sorted(p.name for p in (tmp_path / "cache").glob("*.safetensors")) == [target.name]


def test_a_mesh_that_does_not_fit_keeps_the_cache_entry(llama_model, tmp_path, monkeypatch):
    """A mesh the model's heads do not divide fails when the cached params are placed on it: that error reaches the
    caller and the sound entry stays (it was taken for a corrupt file, deleted and converted again for nothing)."""
    from models import sharding

    monkeypatch.setenv(bundled.CACHE_ENV, str(tmp_path / "cache"))
    path = write_gguf(llama_model, tmp_path / "tiny.gguf")
    load_gguf_cached(path, jnp.float32)
    target = params_cache_path(path, jnp.float32)
    stamp = target.stat().st_mtime_ns

    def misfit(cfg, arrays, dtype, where, mesh=None):
        raise sharding.ShardingError("num_heads (Hq)=4 is not divisible by the mesh's model axis of 3")

    monkeypatch.setattr(bundled, "params_from_numpy", misfit)
    with pytest.raises(sharding.ShardingError, match="not divisible"):
        load_gguf_cached(path, jnp.float32, mesh="a mesh of model=3")
    assert target.is_file() and target.stat().st_mtime_ns == stamp


def test_gguf_rewritten_in_place_with_its_mtime_kept_is_hashed_again(llama_model, tmp_path, monkeypatch):
    """A file rewritten with other weights of the same size, its mtime set back (`cp -p`, `rsync -a`), got the old
    file's cached digest and so its cached weights: the digest key now holds the inode and ctime too. And an F32
    tensor no longer aliases the memory-mapped file (a rewrite changed the loaded model's embedding)."""
    monkeypatch.setenv(bundled.CACHE_ENV, str(tmp_path / "cache"))
    path = write_gguf(llama_model, tmp_path / "tiny.gguf")  # F32 tensors
    _, first = load_gguf(path, jnp.float32)
    embed = np.asarray(first.embed).copy()
    old = bundled.file_digest(path)
    st = path.stat()
    other = tiny_llama(seed=5)
    write_gguf(other, tmp_path / "other.gguf")
    path.write_bytes((tmp_path / "other.gguf").read_bytes())
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns
    assert bundled.file_digest(path) != old
    np.testing.assert_array_equal(np.asarray(first.embed), embed)  # the loaded model kept its own weights


def test_hf_config_fields_as_transformers_reads_them(folder):
    """llama3 RoPE: a missing factor is refused (made up before), the original context taken in transformers'
    order; an attention or MLP bias flag that transformers ignores for an architecture is ignored here too; a
    folder's generation_config.json stop ids end generation (transformers' generate honours them)."""
    from models.bundled import generation_stop_ids
    from models.config import ModelConfig

    base = json.loads((folder / "config.json").read_text())
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    cfg = ModelConfig.from_hf({**base, "rope_scaling": scaling, "rope_parameters": None})
    assert cfg.rope.original_max_position == base["max_position_embeddings"]  # not 8192
    cfg = ModelConfig.from_hf({**base, "rope_scaling": scaling, "rope_parameters": None,
                               "original_max_position_embeddings": 32})
    assert cfg.rope.original_max_position == 32
    with pytest.raises(ConfigError, match="rope_type='llama3' needs low_freq_factor, high_freq_factor"):
        ModelConfig.from_hf({**base, "rope_scaling": {"rope_type": "llama3", "factor": 8.0},
                             "rope_parameters": None})
    # rope_scaling next to rope_parameters: transformers 5 lets the first replace the second (theta too), so a saved
    # config (rope_parameters of type default) with a linear scaling added ran linear x4 there and plain RoPE here.
    default = {"rope_type": "default", "rope_theta": 5e5}
    with pytest.raises(ConfigError, match=r"rope_scaling=\{'type': 'linear', 'factor': 4.0\} \(theta .*\) and "
                                          r"rope_parameters=\{'rope_type': 'default', 'rope_theta': 500000.0\} "
                                          r"\(theta 500000\) disagree"):
        ModelConfig.from_hf({**base, "rope_scaling": {"type": "linear", "factor": 4.0}, "rope_parameters": default})
    both = ModelConfig.from_hf({**base, "rope_scaling": {**scaling, "rope_theta": 5e5},
                                "rope_parameters": {**scaling, "rope_theta": 5e5}})
    # Theta as each side is read: a rope_scaling without one runs transformers' top-level rope_theta (else 10000),
    # not rope_parameters' 5e5, which ran here silently before (logits 2-3 apart at 600 tokens).
    base_theta = float(base.get("rope_theta", 10000.0))
    assert base_theta != 5e5
    with pytest.raises(ConfigError, match=rf"\(theta {base_theta:g}\) and rope_parameters=.*\(theta 500000\) disagree"):
        ModelConfig.from_hf({**base, "rope_scaling": scaling, "rope_parameters": {**scaling, "rope_theta": 5e5}})
    # A missing rope_type is the default type: {"partial_rotary_factor": 1.0} agrees with the same plus "default".
    same = ModelConfig.from_hf({**base, "rope_scaling": {"partial_rotary_factor": 1.0, "rope_theta": 5e5},
                                "rope_parameters": {**default, "partial_rotary_factor": 1.0}})
    assert (same.rope.rope_type, same.rope.theta) == ("default", 5e5)
    assert (both.rope.rope_type, both.rope.theta, both.rope.factor) == ("llama3", 5e5, 8.0)
    with pytest.raises(ConfigError, match=r"rope_parameters per layer type \(\['full_attention'"):
        ModelConfig.from_hf({**base, "rope_parameters": {"full_attention": {**scaling, "rope_theta": 1e6},
                                                         "sliding_attention": default}})
    with pytest.raises(ConfigError, match=r"partial_rotary_factor=0.5 with rope_type='llama3' is not supported"):
        ModelConfig.from_hf({**base, "rope_scaling": scaling, "rope_parameters": None, "partial_rotary_factor": 0.5})
    half = ModelConfig.from_hf({**base, "partial_rotary_factor": 0.5})  # transformers' default RoPE ignores it
    assert half.rope.rope_type == "default"
    mistral = ModelConfig.from_hf({**base, "model_type": "mistral", "attention_bias": True, "mlp_bias": True})
    assert not (mistral.qkv_bias or mistral.o_bias or mistral.mlp_bias)
    assert generation_stop_ids(folder) == ()
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 9]}))
    assert generation_stop_ids(folder) == (5, 9)
    model = bundled.load_model(str(folder), jnp.float32)
    from jsparse.api import eos_ids
    assert set(eos_ids(model)) >= {5, 9}
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(ConfigError, match="eos_token_id='x': expected an integer or a list"):
        generation_stop_ids(folder)


def test_a_key_a_config_leaves_out_means_what_it_means_to_transformers(tmp_path):
    """config.json without an optional key takes the transformers config class's default (jsparse's own defaults
    gave Mistral no window, Llama-3 scaling an 8192-token original context, Qwen3 head_dim hidden / heads);
    without a shape key, or not a JSON object, it is a ConfigError naming the file."""
    from transformers import CONFIG_MAPPING

    from models.config import ConfigError, ModelConfig

    base = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    for mt, extra in (("mistral", {"num_key_value_heads": 2}), ("qwen3", {"num_key_value_heads": 2}),
                      ("qwen2", {"num_attention_heads": 32}),
                      ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0}})):
        d = {**base, **extra}
        ours, ref = ModelConfig.from_hf({"model_type": mt, **d}), CONFIG_MAPPING[mt](**d)
        assert ours.num_kv_heads == ref.num_key_value_heads, mt
        assert ours.head_dim == (getattr(ref, "head_dim", None) or d["hidden_size"] // d["num_attention_heads"]), mt
        assert ours.max_position_embeddings == ref.max_position_embeddings, mt
        assert ours.sliding_window == (ref.sliding_window if mt == "mistral" else None), mt
    assert ModelConfig.from_hf({"model_type": "mistral", **base, "num_key_value_heads": 2}).sliding_window == 4096
    assert ModelConfig.from_hf({"model_type": "qwen3", **base, "num_key_value_heads": 2}).head_dim == 128
    llama3 = ModelConfig.from_hf({"model_type": "llama", **base, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}})
    assert llama3.rope.original_max_position == 2048 == llama3.max_position_embeddings
    no_heads = {k: v for k, v in base.items() if k != "num_attention_heads"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", **no_heads}))
    with pytest.raises(ConfigError, match=r"config.json lacks 'num_attention_heads': a llama config needs"):
        ModelConfig.from_hf(str(path))
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"config.json holds a list: expected a JSON object"):
        ModelConfig.from_hf(str(path))


def test_gguf_metadata_scalars_reach_the_config(tmp_path):
    """rms eps, rope theta, context length and the bos / eos ids come from the file, not from their defaults
    (the tiny model's values equal the defaults 1e-5 / 10000, which hid a reader that ignored them)."""
    model = tiny_llama()
    model.config.rms_norm_eps = 1e-6
    model.config.rope_parameters = {"rope_type": "default", "rope_theta": 500000.0}
    model.config.max_position_embeddings = 300
    path = write_gguf(model, tmp_path / "meta.gguf", extra=lambda w: (w.add_bos_token_id(3), w.add_eos_token_id(5)))
    cfg, _ = load_gguf(path)
    assert cfg.rms_norm_eps == pytest.approx(1e-6, rel=1e-6)
    assert cfg.rope == RopeConfig(theta=500000.0)
    assert cfg.max_position_embeddings == 300
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (3, (5,))


def test_gguf_qwen2_biases_load_equal_to_hf_folder(tmp_path):
    """Qwen2 GGUFs carry q/k/v biases (blk.N.attn_q.bias ...) and are not Q/K-permuted."""
    torch.manual_seed(7)
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = transformers.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "hf")
    cfg_g, params_g = load_gguf(write_gguf(model, tmp_path / "qwen2.gguf"))
    cfg_h, params_h = load_hf_folder(tmp_path / "hf")
    assert cfg_g.architecture == "qwen2" and cfg_g.qkv_bias and not cfg_g.o_bias
    _assert_trees_close(params_g, params_h)


def test_gguf_unknown_tensor_is_named(llama_model, tmp_path):
    extra = lambda w: w.add_tensor("blk.0.attn_gate.weight", np.zeros((4, 4), np.float32))  # noqa: E731
    path = write_gguf(llama_model, tmp_path / "gated.gguf", extra=extra)
    with pytest.raises(ValueError, match=r"gated.gguf: GGUF tensor 'blk.0.attn_gate.weight' is not part of a "
                                         r"decoder this library implements \(unknown tensor\)"):
        load_gguf(path)


def _llama31_rope_freqs(theta, head_dim, factor, low, high, original):
    """llama.cpp's convert_hf_to_gguf.py rope_freqs for Llama 3.1 scaling: per frequency, the divisor of the
    unscaled inverse frequency (1 above the high-frequency wavelength, `factor` below the low, smooth between)."""
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    out = []
    for f in inv:
        wavelen = 2 * np.pi / f
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def test_gguf_rope_freqs_read_as_llama31_scaling_or_refused(llama_model, tmp_path):
    """rope_freqs.weight (llama.cpp's Llama 3.1 frequency divisors) becomes rope_type llama3 with the file's
    factor and original context; divisors that no Llama 3.1 scaling makes are refused. head_dim 16, theta 1e4 and
    an original context of 256 put the 8 frequencies in all three bands."""
    head = llama_model.config.hidden_size // llama_model.config.num_attention_heads
    freqs = _llama31_rope_freqs(10000.0, head, 8.0, 1.0, 4.0, 256)
    assert freqs.min() == 1.0 and freqs.max() == 8.0 and ((freqs > 1) & (freqs < 8)).any()

    def write(name, f):
        return write_gguf(llama_model, tmp_path / name, extra=lambda w: (
            w.add_uint32("llama.rope.scaling.original_context_length", 256), w.add_tensor("rope_freqs.weight", f)))

    cfg, params = load_gguf(write("llama31.gguf", freqs))
    assert cfg.rope == RopeConfig(theta=10000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                  high_freq_factor=4.0, original_max_position=256)
    assert params.lm_head is not None  # rope_freqs is config, not a parameter
    with pytest.raises(ConfigError, match=r"rope_freqs.weight holds frequency factors that are not Llama 3.1 "
                                          r"scaling \(factor=8.0"):
        load_gguf(write("other.gguf", np.linspace(1.0, 8.0, head // 2, dtype=np.float32)))


def test_tensor_the_config_does_not_enable_is_refused(tmp_path):
    """A bias the checkpoint holds but config.json switches off would be dropped silently (different outputs)."""
    tiny_llama(attention_bias=True).save_pretrained(tmp_path)
    _edit_config(tmp_path, attention_bias=False)
    with pytest.raises(ValueError, match=r"tensor 'model.layers.\d+.self_attn.([qkvo])_proj.bias' is present but "
                                         r"config.json does not enable it \(b\1 for architecture 'llama'\)"):
        load_hf_folder(tmp_path)


def test_tensor_of_a_layer_beyond_the_config_is_named(folder):
    """A checkpoint with more layers than config.json says would be truncated silently."""
    _edit_config(folder, num_hidden_layers=1)
    with pytest.raises(ValueError, match=r"tensor 'model.layers.1.[a-z_.]+' is for layer 1, but the config has "
                                         r"num_layers=1 \(valid 0..0\)"):
        load_hf_folder(folder)


def test_from_transformers_returns_the_dtype_asked_for(llama_model):
    _, ref = from_transformers(llama_model)
    _, half = from_transformers(llama_model, jnp.bfloat16)
    for a, b in zip(jax.tree_util.tree_leaves(half), jax.tree_util.tree_leaves(ref)):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b.astype(jnp.bfloat16)))


def test_gguf_cache_keeps_one_entry_per_dtype(llama_model, tmp_path, monkeypatch):
    """f32 and bf16 conversions of one file are two cache entries: alternating dtypes hits both, with no rebuild."""
    import warnings

    monkeypatch.setenv(bundled.CACHE_ENV, str(tmp_path / "cache"))
    path = write_gguf(llama_model, tmp_path / "tiny.gguf")
    assert params_cache_path(path, jnp.float32) != params_cache_path(path, jnp.bfloat16)
    assert not load_gguf_cached(path, jnp.float32)[2] and not load_gguf_cached(path, jnp.bfloat16)[2]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a "rebuilding unreadable cache entry" warning fails the test
        _, p32, hit32 = load_gguf_cached(path, jnp.float32)
        _, p16, hit16 = load_gguf_cached(path, jnp.bfloat16)
    assert hit32 and hit16
    assert p32.embed.dtype == jnp.float32 and p16.embed.dtype == jnp.bfloat16


def test_generation_config_boolean_eos_is_named(folder):
    from models.bundled import generation_stop_ids

    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, True]}))
    with pytest.raises(ConfigError, match=r"eos_token_id=\[2, True\]: expected an integer or a list"):
        generation_stop_ids(folder)
