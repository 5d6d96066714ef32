"""`Predictor.__call__` against a float64 numpy transcription of butler_predictor's module docstring (TokenButler's
predictor): down-projection, causal softmax attention with RoPE (scaled by 1/sqrt(head width)) plus residual,
LayerNorm, feed-forward back up to E plus the residual x, then q' = rope(q_out(silu(q_in(y)))) and
k' = rope(k_out(silu(k_in(y)))). The suite compared the module only with itself (extend against __call__,
training against training), so dropping the attention scale or the residual went unnoticed."""

import jax
import jax.numpy as jnp
import numpy as np

from jsparse.methods.butler_predictor import Predictor, PredictorConfig, init_params


def rope(x, pos, theta):  # x: [B, T, H, d], rotate-half convention
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    f = pos[..., None] * inv
    emb = np.concatenate([f, f], -1)[:, :, None]
    rot = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * np.cos(emb) + rot * np.sin(emb)


def silu(x):
    return x / (1 + np.exp(-x))


def reference(p, c: PredictorConfig, x, pos):
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    B, T, _ = x.shape
    h = x @ p["down"]["kernel"]
    q = rope(np.einsum("btd,dhk->bthk", h, p["wq"]["kernel"]), pos, c.rope_theta)
    k = rope(np.einsum("btd,dhk->bthk", h, p["wk"]["kernel"]), pos, c.rope_theta)
    v = np.einsum("btd,dhk->bthk", h, p["wv"]["kernel"])
    s = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    h = h + np.einsum("bthk,hkd->btd", np.einsum("bhts,bshd->bthd", w, v), p["wo"]["kernel"])
    mu, var = h.mean(-1, keepdims=True), h.var(-1, keepdims=True)
    h = (h - mu) / np.sqrt(var + c.ln_eps) * p["norm"]["scale"] + p["norm"]["bias"]
    y = x + silu(h @ p["ffn_up"]["kernel"] + p["ffn_up"]["bias"]) @ p["ffn_down"]["kernel"] + p["ffn_down"]["bias"]
    Lp = c.num_layers - 1

    def net(a, b, heads):
        out = silu(y @ p[a]["kernel"] + p[a]["bias"]) @ p[b]["kernel"] + p[b]["bias"]
        return rope(out.reshape(B, T, Lp * heads, c.head_dim), pos, c.rope_theta).reshape(B, T, Lp, heads, c.head_dim)

    return net("q_in", "q_out", c.num_heads), net("k_in", "k_out", c.key_heads)


def test_predictor_forward_matches_the_reference():
    c = PredictorConfig(hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, down_dim=16, attn_heads=2,
                        ffn_dim=24, qk_hidden=20, head_dim=8, key_heads=2)
    params = init_params(c, jax.random.key(0))
    # Larger attention weights than the default init, so that the softmax's scale matters.
    params = {**params, "wq": {"kernel": params["wq"]["kernel"] * 4.0}, "wk": {"kernel": params["wk"]["kernel"] * 4.0}}
    x = np.asarray(jax.random.normal(jax.random.key(1), (2, 12, 32)), np.float64)
    pos = np.broadcast_to(np.arange(12), (2, 12))
    qp, kp = Predictor(c).apply({"params": params}, jnp.asarray(x, jnp.float32), jnp.asarray(pos, jnp.int32))
    want_q, want_k = reference(params, c, x, pos)
    for got, want in ((qp, want_q), (kp, want_k)):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
