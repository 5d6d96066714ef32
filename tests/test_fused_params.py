"""The fused q/k/v and gate/up layout (`models.params.fuse_projections`, what `jsparse.load` gives on a GPU):
the same outputs, fingerprints and saved tensors as the separate layout, and clear errors where it cannot go."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse
from jsparse.api import generate_ids
from jsparse.artifacts import model_fingerprint
from jsparse.methods import make_method
from models import llama, params as P, sharding
from models.bundled import keep_layers
from models.cache import init_cache
from models.config import ModelConfig
from models.convert import params_to_numpy

BASE = dict(architecture="llama", vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4,
            num_kv_heads=2, head_dim=16, max_position_embeddings=256)
CONFIGS = {
    "llama": ModelConfig(**BASE),
    "qwen2_biases": ModelConfig(**{**BASE, "architecture": "qwen2", "qkv_bias": True}),
    "qwen3_qk_norm": ModelConfig(**{**BASE, "architecture": "qwen3", "qk_norm": True}),
    "llama_all_biases": ModelConfig(**{**BASE, "o_bias": True, "mlp_bias": True, "qkv_bias": True}),
}


def _random(cfg, seed=0):
    p = P.random_params(cfg, jax.random.key(seed), jnp.float32, scale=0.3)
    # Norm weights away from ones, so a q/k norm applied to the wrong heads would show.
    return jax.tree_util.tree_map_with_path(
        lambda path, x: x + 0.2 * jax.random.normal(jax.random.key(7), x.shape) if "norm" in jax.tree_util.keystr(
            path) else x, p)


def _run(cfg, params, method_name):
    m = make_method(method_name, **({"budget": 0.3, "min_tokens": 6} if method_name == "h2o" else {}))
    tokens = jax.random.randint(jax.random.key(3), (3, 13), 0, cfg.vocab_size)
    lengths = jnp.array([13, 11, 7])
    st = m.init_state(cfg, 3, 32)
    logits, cache, st, hidden = llama.prefill(params, cfg, m, tokens, lengths, init_cache(cfg, 3, 32, jnp.float32),
                                              st, all_logits=True, return_hidden=True)
    step = llama.decode(params, cfg, m, tokens[:, :5], cache, st)
    return logits, cache, hidden, step


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fused_forward_equals_separate(name):
    cfg = CONFIGS[name]
    sep = _random(cfg)
    fused = P.fuse_projections(sep)
    assert P.is_fused(fused) and not P.is_fused(sep)
    assert fused.layers.wq is None and fused.layers.w_up is None and fused.layers.fused_heads == (4, 2)
    assert fused.layers.wqkv.shape == (3, 64, 8, 16) and fused.layers.w_gate_up.shape == (3, 64, 192)
    assert (fused.layers.bqkv is not None) == cfg.qkv_bias and (fused.layers.b_gate_up is not None) == cfg.mlp_bias
    for method in ("dense", "h2o") if name == "llama_all_biases" else ("dense",):  # a sparse method's state once
        for a, b in zip(jax.tree_util.tree_leaves(_run(cfg, sep, method)),
                        jax.tree_util.tree_leaves(_run(cfg, fused, method))):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)  # GPU f32 GEMMs too


def test_unfuse_views_fingerprint_and_saved_tensors_match_the_separate_layout():
    cfg = CONFIGS["llama_all_biases"]
    sep = _random(cfg)
    fused = P.fuse_projections(sep)
    assert P.fuse_projections(fused) is fused  # already fused: unchanged
    back = P.unfuse_projections(fused)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(sep)
    for a, b in zip(jax.tree_util.tree_leaves(sep), jax.tree_util.tree_leaves(back)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    views = P.projection_views(fused)
    assert isinstance(views.layers.wk, P.Slice) and views.layers.wk.shape == sep.layers.wk.shape
    P.check_shapes(cfg, jax.tree_util.tree_map(lambda x: x.get() if isinstance(x, P.Slice) else x, views))
    assert model_fingerprint(cfg, fused) == model_fingerprint(cfg, sep)
    other = sep.replace(layers=sep.layers.replace(wv=sep.layers.wv.at[1, 3, 1, 2].add(1.0)))
    assert model_fingerprint(cfg, P.fuse_projections(other)) != model_fingerprint(cfg, fused) or \
        model_fingerprint(cfg, other) == model_fingerprint(cfg, sep)  # the sample may miss one element: then both do
    a, b = params_to_numpy(fused), params_to_numpy(sep)
    assert sorted(a) == sorted(b) and "layers.wq" in a
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    host = P.unfuse_projections(jax.tree_util.tree_map(np.asarray, fused))  # numpy leaves slice too
    np.testing.assert_array_equal(host.layers.w_up, np.asarray(sep.layers.w_up))


def test_donate_deletes_the_separate_weights():
    sep = _random(CONFIGS["llama"])
    wq, w_up, wo = sep.layers.wq, sep.layers.w_up, sep.layers.wo
    fused = P.fuse_projections(sep, donate=True)
    assert wq.is_deleted() and w_up.is_deleted() and not wo.is_deleted()
    assert not fused.layers.wqkv.is_deleted()


def test_the_default_layout_is_fused_on_a_gpu_only(monkeypatch):
    sep = _random(CONFIGS["llama"])
    assert P.fuse_by_default() == (jax.default_backend() == "gpu")
    assert not P.fuse_by_default(mesh=object())  # never on a mesh
    assert P.is_fused(P.with_layout(sep)) == P.fuse_by_default()
    assert P.is_fused(P.with_layout(sep, "fused")) and not P.is_fused(P.with_layout(P.fuse_projections(sep), "separate"))
    with pytest.raises(ValueError, match="layout='packed'"):
        P.with_layout(sep, "packed")
    # On a GPU (simulated: a CPU host sees only the backend check): fused without a mesh, separate on any mesh
    # (sharding splits the separate weights by heads).
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert P.fuse_by_default() and not P.fuse_by_default(mesh=object())
    assert P.is_fused(P.with_layout(sep)) and not P.is_fused(P.with_layout(sep, mesh=object()))


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    import torch
    import transformers

    tmp_path = tmp_path_factory.mktemp("fused")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1, bos_token_id=None,
        eos_token_id=None, pad_token_id=None)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


def test_load_fused_generates_what_separate_does_and_keeps_layers(hf_folder):
    folder = hf_folder
    sep = jsparse.load(str(folder), dtype="float32", fuse=False)
    fused = jsparse.load(str(folder), dtype="float32", fuse=True)
    assert P.is_fused(fused.params) and not P.is_fused(sep.params)
    assert jsparse.fingerprint(fused) == jsparse.fingerprint(sep)
    ids = [[5, 9, 11, 2, 40, 7], [3, 3, 8]]
    a = generate_ids(sep, ids, max_new_tokens=6)
    b = generate_ids(fused, ids, max_new_tokens=6)
    assert a == b
    draft = jsparse.load(f"{folder}:layers=0,2", dtype="float32", fuse=True)
    assert P.is_fused(draft.params) and draft.cfg.num_layers == 2
    np.testing.assert_array_equal(np.asarray(P.unfuse_projections(draft.params).layers.wk),
                                  np.asarray(sep.params.layers.wk)[[0, 2]])
    np.testing.assert_array_equal(np.asarray(keep_layers(fused, [1]).params.layers.wqkv),
                                  np.asarray(fused.params.layers.wqkv)[[1]])


def test_fused_params_on_a_mesh_are_refused_or_unfused(hf_folder):
    folder = hf_folder
    fused = jsparse.load(str(folder), dtype="float32", fuse=True)
    mesh = sharding.make_mesh("data=1,model=1")
    with pytest.raises(sharding.ShardingError, match="fused q/k/v"):
        sharding.param_shardings(fused.cfg, mesh, fused.params)
    with pytest.raises(ValueError, match="fuse=True with a mesh"):
        jsparse.load(str(folder), dtype="float32", mesh=mesh, fuse=True)
    placed = jsparse.on_mesh(fused, mesh)
    assert not P.is_fused(placed.params) and placed.mesh is mesh
    assert jsparse.fingerprint(dataclasses.replace(placed)) == jsparse.fingerprint(fused)


@pytest.mark.parametrize("name", ["llama_all_biases", "qwen3_qk_norm"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_layer_reader_reads_each_layer_exactly(name, dtype, monkeypatch):
    """The layer scans read each layer's params at the loop counter, the norms and biases packed in one f32 row
    per layer (`llama._layer_reader`): every leaf of every layer comes back bit for bit, in its dtype."""
    monkeypatch.setattr(llama, "SMALL_LAYER_LEAF", 256)  # this model's weights are small: only norms and biases
    cfg = CONFIGS[name]
    params = jax.tree_util.tree_map(lambda a: a.astype(dtype), _random(cfg))
    for layout in ("default", "fused"):
        p = P.with_layout(params, layout) if layout == "fused" else params
        read = llama._layer_reader(cfg, p, make_method("dense"))
        for i in range(cfg.num_layers):
            lp, info, window = jax.jit(read)(jnp.int32(i))
            want = jax.tree_util.tree_map(lambda a: a[i], p.layers)
            assert jax.tree_util.tree_structure(lp) == jax.tree_util.tree_structure(want)
            for got, ref in zip(jax.tree_util.tree_leaves(lp), jax.tree_util.tree_leaves(want)):
                assert got.dtype == ref.dtype and got.shape == ref.shape
                np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32)))
            assert info is None and int(window) == 0
        # One slice per weight and one for all the small leaves.
        big = [a for a in jax.tree_util.tree_leaves(p.layers) if a[0].size > llama.SMALL_LAYER_LEAF]
        small = [a for a in jax.tree_util.tree_leaves(p.layers) if a[0].size <= llama.SMALL_LAYER_LEAF]
        assert len(small) >= 3 and _count(jax.make_jaxpr(read)(jnp.int32(0)).jaxpr, "dynamic_slice") == len(big) + 1


def _count(jaxpr, primitive: str) -> int:
    """Equations of `primitive` in a jaxpr, nested jaxprs included."""
    n = 0
    for e in jaxpr.eqns:
        n += e.primitive.name == primitive
        for v in e.params.values():
            inner = getattr(v, "jaxpr", None)
            if inner is not None:
                n += _count(getattr(inner, "jaxpr", inner), primitive)
    return n


def test_sharded_steps_name_the_fused_layout():
    """`sharded_prefill_step` with fused params: the ShardingError that names the layout and the fix, as
    `sharded_generate_tokens` gives (device_put failed with a pytree-structure error)."""
    from models.generate import sharded_prefill_step

    cfg = CONFIGS["llama"]
    fused = P.fuse_projections(_random(cfg))
    mesh = sharding.make_mesh("model=1")
    tokens, lengths = jnp.zeros((1, 8), jnp.int32), jnp.array([8])
    with pytest.raises(sharding.ShardingError, match="fused q/k/v and gate/up layout .*unfuse_projections"):
        sharded_prefill_step(mesh, fused, make_method("dense"), tokens, lengths, init_cache(cfg, 1, 16, jnp.float32),
                             None, cfg=cfg)


def test_saved_arrays_of_the_wrong_shape_are_named():
    """`params_from_numpy` (the GGUF cache's reader) checks every shape against the config (`check_shapes`)."""
    from models.convert import params_from_numpy

    cfg = CONFIGS["llama"]
    arrays = params_to_numpy(_random(cfg))
    params_from_numpy(cfg, arrays)  # sound arrays load
    L, E, Hkv, D = cfg.num_layers, cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim
    bad = {**arrays, "layers.wk": arrays["layers.wk"][:, :, :1]}
    with pytest.raises(ValueError, match=rf"saved.npz: tensor \.layers\.wk has shape \({L}, {E}, 1, {D}\), but the "
                                         rf"config implies \({L}, {E}, {Hkv}, {D}\)"):
        params_from_numpy(cfg, bad, where="saved.npz")


def test_random_params_norms_are_ones():
    cfg = CONFIGS["qwen3_qk_norm"]
    params = P.random_params(cfg, jax.random.key(0), jnp.float32)
    for norm in (params.final_norm, params.layers.attn_norm, params.layers.mlp_norm, params.layers.q_norm,
                 params.layers.k_norm):
        np.testing.assert_array_equal(np.asarray(norm), 1.0)
    assert float(jnp.std(params.layers.wq)) == pytest.approx(0.02, rel=0.1)
