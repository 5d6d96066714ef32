"""Shared selection machinery: budgets, exact (pooled) scores, top-k to the index contract, top-k by threshold.

Index contract (README.md, Library; models/attention.py): `int32[B, Hkv, T, K]`, ascending, padded with -1 at the
end; T = 1 (or the number of new tokens) in decode, one row per query tile in prefill.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import sharding as shard
from pallas_kernels.anchor_attention.common import budget_count

Array = jax.Array
NEG_INF = -jnp.inf


def check_budget(budget: float) -> float:
    """Budget as a fraction of the context: must lie in (0, 1]."""
    if not is_real(budget) or not 0.0 < float(budget) <= 1.0:
        raise ValueError(f"budget={budget!r}: expected a fraction of the context in (0, 1]")
    return float(budget)


def is_real(value) -> bool:
    """Whether `value` is a real number, Python or numpy (np.float32 included), and not a bool."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def is_int(value) -> bool:
    """Whether `value` is an integer, Python or numpy, and not a bool (True would read as 1)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_positive_int(name: str, value, minimum: int = 1) -> int:
    """An integer (Python or numpy, not bool) >= minimum, returned as a Python int."""
    if not is_int(value) or value < minimum:
        raise ValueError(f"{name}={value!r}: expected an integer >= {minimum}")
    return int(value)


def integer_array(name: str, value) -> np.ndarray:
    """`value` as a numpy array of an integer dtype, as given; ValueError naming `name` for any other dtype (a
    float or bool index map would be truncated or read as 0 / 1 by a cast)."""
    arr = np.asarray(value)
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} has dtype {arr.dtype}: expected integers (indices)")
    return arr


def check_layers(name: str, layers, num_layers: int) -> tuple[int, ...]:
    """Distinct layer indices in [0, num_layers), as a sorted tuple of ints (a hashable static field)."""
    if isinstance(layers, (str, bytes)) or not hasattr(layers, "__iter__"):
        raise ValueError(f"{name}={layers!r}: expected a sequence of layer indices")
    layers = list(layers)
    if not all(is_int(l) for l in layers):
        raise ValueError(f"{name}={layers!r}: expected integer layer indices (17.6 or True would be read as another "
                         "layer)")
    layers = tuple(sorted(int(l) for l in layers))
    if len(set(layers)) != len(layers) or (layers and (layers[0] < 0 or layers[-1] >= num_layers)):
        raise ValueError(f"{name}={list(layers)}: expected distinct layers in [0, {num_layers})")
    return layers


def budget_tokens(budget: float, n, min_tokens: int = 128):
    """k = min(max(ceil(budget * n), min_tokens), n) (Kascade's budget rule); works on ints and int arrays.

    The kernels' rule (`pallas_kernels.anchor_attention.common.budget_count`), one definition for both: budget * n
    is an f32 product for an int n too, so a static width holds the k a traced row of the same n computes (in f64,
    ceil(0.3 * 3200) = 960 but the f32 row's is 961)."""
    return budget_count(budget, n, min_tokens)


def keys_to_keep(n, budget: float, min_tokens: int = 128, tokens: int | None = None):
    """Keys kept among n visible ones (int or int array): min(tokens, n) with a token count `tokens`, else the
    fraction rule `budget_tokens(budget, n, min_tokens)`."""
    if tokens is None:
        return budget_tokens(budget, n, min_tokens)
    if isinstance(n, int):
        return min(int(tokens), n)
    return jnp.minimum(jnp.int32(int(tokens)), n)


def decode_positions(lengths: Array, T: int) -> Array:
    """i32[B, T]: position of each of the T newest tokens (query t of row b sits at lengths[b] - T + t)."""
    return lengths[:, None] - T + jnp.arange(T, dtype=jnp.int32)[None]


def group_probs(q: Array, k_cache: Array, positions: Array) -> Array:
    """Exact causal post-softmax attention weights of every query head, grouped by KV head.

    Args:
      q: [B, T, Hq, D]; k_cache: [B, Hkv, N, D]; positions: i32[B, T] (query t sees keys <= positions[b, t]).
    Returns:
      f32[B, Hkv, G, T, N] (G = Hq / Hkv; query head h is group member h % G of KV head h // G; a row with no
      visible key is NaN).
    """
    B, T, Hq, D = q.shape
    Hkv, N = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    qg = q.reshape(B, T, Hkv, G, D)
    logits = jnp.einsum("btkgd,bknd->bkgtn", qg, k_cache, preferred_element_type=jnp.float32) / math.sqrt(D)
    visible = jnp.arange(N)[None, None, :] <= positions[:, :, None]  # [B, T, N]
    logits = jnp.where(visible[:, None, None], logits, NEG_INF)
    return jax.nn.softmax(logits, axis=-1)


def pooled_probs(q: Array, k_cache: Array, positions: Array) -> Array:
    """Exact post-softmax attention weights summed over each GQA group (`group_probs` summed over G).

    Args:
      q: [B, T, Hq, D]; k_cache: [B, Hkv, N, D]; positions: i32[B, T] (query t sees keys <= positions[b, t]).
    Returns:
      f32[B, Hkv, T, N] (each row sums to G over the visible keys, 0 elsewhere).
    """
    return group_probs(q, k_cache, positions).sum(axis=2)


def group_sum(scores: Array, num_kv_heads: int, axis: int = 1) -> Array:
    """Per-query-head scores pooled over each GQA group: the Hq entries of `axis` -> Hkv sums (query head h
    belongs to KV head h // G)."""
    Hq = scores.shape[axis]
    if Hq % num_kv_heads:
        raise ValueError(f"{Hq} query heads do not split into {num_kv_heads} KV heads' groups")
    shape = scores.shape[:axis] + (num_kv_heads, Hq // num_kv_heads) + scores.shape[axis + 1:]
    return scores.reshape(shape).sum(axis=axis + 1)


PROB_CHUNK_ROWS = 256  # query rows per chunk of `causal_prob_fold` (the prefill's exact scores)
PROB_BANDS = 8  # key-width bands of `causal_prob_fold`: its work is (bands + 1) / (2 bands) of the [T, T] map


def causal_prob_fold(q: Array, k: Array, fn, init, rows: int = PROB_CHUNK_ROWS, bands: int = PROB_BANDS):
    """Folds `fn` over the prefill's exact causal pooled weights (`pooled_probs` of every row), chunk of query rows
    by chunk inside `lax.scan`s, so that one chunk's weights are live at a time whatever the backend's scheduler
    does (chunks in an unrolled Python loop, as H2O and the oracle computed them before, leave it free to keep
    them all: on the CPU their compiled temp memory held about half the [B, Hq, T, T] f32 map). The one place
    the prefill's exact [T, T] weights are computed (H2O's score, the oracle's and Kascade calibration's tile
    scores through `prefill_tile_probs`).

    The chunks (T padded up to a multiple of `rows`) go in `bands` runs of consecutive chunks, one scan each; a
    run's rows see the keys 0..W-1, W the end of its last chunk (static), with the causal mask inside it (the
    weights of keys past a row's position are 0). Its work is (bands + 1) / (2 bands) of the full map's (the
    exact triangle is 1/2), its memory one chunk's f32[B, Hkv, G, rows, W] and fn's carry.

    Args:
      q: [B, T, Hq, D]; k: [B, T, Hkv, D].
      fn: (carry, s: i32[] the chunk's first row, probs: f32[B, Hkv, rows, W]) -> carry; rows s + i >= T are
        padding (their weights are a valid causal row; fn drops them).
      init: the initial carry (a pytree of arrays, shapes fixed).
      rows, bands: query rows per chunk and the number of scans (static; bands is cut to the chunks' count).
    Returns:
      the final carry.
    """
    B, T = q.shape[:2]
    rows, bands = check_positive_int("rows", rows), check_positive_int("bands", bands)
    n = -(-T // rows)
    qp = jnp.pad(q, ((0, 0), (0, n * rows - T), (0, 0), (0, 0)))
    kh = jnp.swapaxes(k, 1, 2)  # [B, Hkv, T, D]
    carry = init
    for run in np.array_split(np.arange(n), min(bands, n)):
        W = min(int(run[-1] + 1) * rows, T)
        kw = kh[:, :, :W]

        def body(c, s, kw=kw):
            q_s = jax.lax.dynamic_slice_in_dim(qp, s, rows, axis=1)  # [B, rows, Hq, D]
            positions = jnp.broadcast_to(s + jnp.arange(rows, dtype=jnp.int32), (B, rows))
            return fn(c, s, pooled_probs(q_s, kw, positions)), None

        carry, _ = jax.lax.scan(body, carry, jnp.asarray(run * rows, jnp.int32))
    return carry


def row_limits(lengths: Array | None, B: int, T: int) -> Array:
    """i32[B]: the query rows of a prefill that count per batch row, min(lengths, T) (None: all T)."""
    if lengths is None:
        return jnp.full((B,), T, jnp.int32)
    return jnp.minimum(jnp.asarray(lengths, jnp.int32), T)


def prefill_tile_probs(q: Array, k: Array, tile: int, lengths: Array | None = None) -> Array:
    """Causal post-softmax weights pooled over the GQA group and over each query tile.

    Args:
      q: [B, T, Hq, D]; k: [B, T, Hkv, D]; tile: query rows per tile (T is padded up to a multiple; the padding
        rows add nothing); lengths: i32[B] valid rows per batch row, or None (all T): the rows at or past a row's
        length (its right padding, whatever tokens fill it) add nothing, so the tile that holds a prompt's end
        chooses its keys from the prompt's own queries alone.
    Returns:
      f32[B, Hkv, ceil(T / tile), T]. Computed by `causal_prob_fold` in chunks of max(1, PROB_CHUNK_ROWS // tile)
      whole tiles, each written into the result in place: the memory is the result and one chunk's weights, never
      the [T, T] map.
    """
    B, T = q.shape[:2]
    Hkv = k.shape[2]
    tile = check_positive_int("tile", tile)
    per = max(1, PROB_CHUNK_ROWS // tile)  # tiles per chunk
    rows = per * tile
    n_tiles = -(-T // tile)

    def put(out, s, probs):  # probs: [B, Hkv, rows, W], rows s..s+rows-1 over keys 0..W-1
        W = probs.shape[3]
        real = (s + jnp.arange(rows) < limit[:, None])[:, None, :, None]  # rows past T or lengths add nothing
        pooled = jnp.where(real, probs, 0.0).reshape(B, Hkv, per, tile, W).sum(axis=3)  # [B, Hkv, per, W]
        pooled = jnp.pad(pooled, ((0, 0), (0, 0), (0, 0), (0, T - W)))
        return jax.lax.dynamic_update_slice_in_dim(out, pooled, s // tile, axis=2)

    limit = row_limits(lengths, B, T)
    init = jnp.zeros((B, Hkv, -(-T // rows) * per, T), jnp.float32)  # whole chunks' tiles, cut to n_tiles below
    out = causal_prob_fold(q, k, put, init, rows=rows)
    return out if out.shape[2] == n_tiles else out[:, :, :n_tiles]


def topk_indices(scores: Array, k_dyn: Array, K: int, per_shard: bool = False) -> Array:
    """Top-k key positions per row, in the index contract.

    Args:
      scores: f32[..., N] (keys that may not be chosen must be -inf).
      k_dyn: i32[...] how many to keep per row (<= K); K: static width.
    Returns:
      int32[..., min(K, N)]: the chosen positions ascending, then -1 padding (also for -inf picks).

    per_shard: under a mesh, select scores in the index contract's layout [B, Hkv, ..., N] per shard (rows over
    data, heads over model; the rows are independent), for scores computed per KV head: XLA's partitioner
    gathers every head's scores onto every device for the top-k otherwise (oracle, h2o, butler). Off, XLA places
    the top-k.
    """
    if per_shard and scores.ndim >= 3 and shard.active_mesh() is not None:
        k_rows = jnp.broadcast_to(k_dyn, scores.shape[:-1])
        return shard.per_shard(lambda s, k: _topk_indices(s, k, K), [scores, k_rows],
                               [shard.dims(scores.ndim, 0, 1), shard.dims(scores.ndim - 1, 0, 1)],
                               shard.dims(scores.ndim, 0, 1))
    return _topk_indices(scores, k_dyn, K)


def _topk_indices(scores: Array, k_dyn: Array, K: int) -> Array:
    K = min(K, scores.shape[-1])
    vals, idx = jax.lax.top_k(scores, K)
    rank = jnp.arange(K, dtype=jnp.int32)
    keep = (rank < k_dyn[..., None]) & (vals > NEG_INF)
    big = jnp.iinfo(jnp.int32).max
    idx = jnp.sort(jnp.where(keep, idx, big), axis=-1)
    return jnp.where(idx == big, -1, idx).astype(jnp.int32)


def coverage_drop_count(scores: Array, eligible: Array, tau: float) -> Array:
    """Dynamic coverage (TSA's tau; top-p from the other end): how many eligible keys of each row can be dropped,
    least mass first, while the dropped share of the row's mass stays below tau.

    Args:
      scores: f32[..., N] (>= 0); eligible: bool[..., N] the keys that count; tau: in [0, 1).
    Returns:
      i32[...]: #{i : cumsum(sorted p)_i < tau}, p the eligible scores normalised to sum 1 (0 for tau = 0).
    """
    g = jnp.where(eligible, scores, 0.0)
    total = jnp.sum(g, axis=-1, keepdims=True)
    p = jnp.where(eligible, g / jnp.where(total > 0, total, 1.0), jnp.inf)  # ineligible keys sort last
    cum = jnp.cumsum(jnp.sort(p, axis=-1), axis=-1)
    return jnp.sum(cum < tau, axis=-1, dtype=jnp.int32)


_SENTINEL_BITS = 0x7F800001  # one above the bit pattern of +inf: no non-negative f32 score reaches it


def kth_largest_bits(bits: Array, k: Array) -> Array:
    """The bit pattern of each row's k-th largest entry: max t with #{bits >= t} >= k (0x7f800000 when k = 0).

    bits: i32[..., N] non-negative f32 scores as int32 (order-preserving), -1 for keys not to be chosen;
    k: i32 broadcastable to bits.shape[:-1], at most the number of choosable keys. A binary search over the 31-bit range: 31 counting
    passes over the scores, no sort (top-k by threshold, as kernels without a sort can do it).
    """
    lo = jnp.zeros(bits.shape[:-1], jnp.int32)
    hi = jnp.full(bits.shape[:-1], _SENTINEL_BITS, jnp.int32)

    def body(_, lohi):
        lo, hi = lohi
        mid = lo + (hi - lo) // 2
        ok = jnp.sum(bits >= mid[..., None], axis=-1, dtype=jnp.int32) >= k
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, _ = jax.lax.fori_loop(0, 31, body, (lo, hi))
    return lo


def topk_mask(scores: Array, k: Array, eligible: Array) -> Array:
    """bool[..., N]: the k highest-scoring eligible keys of each row (ties: the lower position first), by threshold.

    Args:
      scores: f32[..., N] (negative scores count as 0); k: i32 broadcastable to scores.shape[:-1], how many to
        keep, at most the number of eligible keys per row; eligible: bool[..., N] (broadcast against scores) the keys that may be chosen.
    """
    s = scores.astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(jnp.where(s > 0, s, 0.0), jnp.int32)
    bits = jnp.where(eligible, bits, -1)
    thr = kth_largest_bits(bits, k)[..., None]
    above = bits > thr
    need = k[..., None] - jnp.sum(above, axis=-1, keepdims=True, dtype=jnp.int32)
    tied = bits == thr
    return above | (tied & (jnp.cumsum(tied, axis=-1, dtype=jnp.int32) <= need))


def tile_starts(T: int, tile: int) -> Array:
    """i32[ceil(T / tile)]: first query position of every tile."""
    return jnp.arange(-(-T // tile), dtype=jnp.int32) * tile


def before_tile_scores(scores: Array, tile: int) -> Array:
    """Masks f32[B, H, nT, N] scores to the keys strictly before each tile (the kernel adds the diagonal tile)."""
    n_tiles, N = scores.shape[2], scores.shape[3]
    before = jnp.arange(N)[None, :] < (jnp.arange(n_tiles) * tile)[:, None]
    return jnp.where(before, scores, NEG_INF)


def topk_kept(budget: float, n, min_tokens: int = 128) -> np.ndarray:
    """f64 keys a top-k rule keeps of n visible ones (numpy, any shape): `budget_tokens`' rule, its f32 product."""
    n = np.asarray(n, np.int64)
    return np.minimum(np.maximum(np.ceil(np.float32(budget) * n.astype(np.float32)), min_tokens), n).astype(np.float64)


def topk_sparsity(budget: float, positions, min_tokens: int = 128) -> float:
    """Mean fraction of visible keys a top-k rule skips over query positions (0-based)."""
    n = np.asarray(positions, np.int64) + 1
    return float(np.mean(1.0 - topk_kept(budget, n, min_tokens) / n))


def topk_map_entries(budget: float | None, n, min_tokens: int = 128) -> np.ndarray:
    """f64[...] the causal-map entries (query, key) a top-k rule attends over sequences of n tokens (int array):
    the sum over query positions i < n of its kept keys among i + 1 (decode rule); n (n + 1) / 2 for budget None
    (a dense layer)."""
    n = np.asarray(n, np.int64)
    if budget is None:
        return n * (n + 1) / 2.0
    cum = np.concatenate([[0.0], np.cumsum(topk_kept(budget, np.arange(1, int(n.max(initial=0)) + 1), min_tokens))])
    return cum[np.maximum(n, 0)]

