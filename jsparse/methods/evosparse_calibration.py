"""EvoSparse calibration: retrieval-head detection by needle copying (as Wu et al., "Retrieval Head").

Prompts (built with the model's own tokenizer, in token space, exact lengths):

    [special prefix] INTRO  FILLER[:d]  NEEDLE  FILLER[d:]  QUESTION
    NEEDLE   " The special magic words are: w1 w2 ... wk."     (k random words, `needle_words`)
    QUESTION " What are the special magic words? The special magic words are:"

The filler is the CLI's development windows (consecutive corpus tokens); each window gives one prompt per
(length, depth). The model decodes greedily with dense attention for |needle| = len(tokens(" w1 ... wk"))
steps. At every step, for every (layer, query head), the head's top-1 attended position j (argmax of its dense
attention weights, recorded by `_ArgmaxRecorder` from the query that produces the step's token) scores
1/|needle| when j lies in the needle's words and the generated token equals tokens[j] (copy-paste). A prompt's
scores are averaged over the prompts where the model retrieved the needle (at least `min_recall` of the needle
tokens reproduced in place); when no prompt does, over all prompts (meta["fallback"] says so, and a warning).

The artifact (kind "evosparse") keeps every head's score, f32[L, Hq]; the method takes the top N heads.
"""

from __future__ import annotations

import functools
import warnings
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jsparse.artifacts import Artifact
from jsparse.methods.base import register_calibration
from jsparse.methods.common import dense_decode, dense_prefill
from jsparse.methods.evosparse import ARTIFACT_KIND
from jsparse.retrieval_heads import DEFAULT_HEAD_FRACTION, top_heads
from models import llama
from models.cache import init_cache

INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. Find it and "
         "memorize it. I will quiz you about the important information there.")
NEEDLE = " The special magic words are:"
QUESTION = " What are the special magic words? The special magic words are:"
WORDS = ("apple", "river", "stone", "garden", "window", "silver", "candle", "marble", "forest", "pepper",
         "tiger", "violin", "copper", "harbor", "lemon", "pencil", "rocket", "saddle", "tunnel", "velvet",
         "anchor", "basket", "cactus", "dragon", "engine", "falcon", "guitar", "hammer", "island", "jacket",
         "kettle", "ladder", "magnet", "needle", "orange", "parrot", "quartz", "rabbit", "salmon", "teapot",
         "umbrella", "valley", "walnut", "yellow", "zebra", "bridge", "castle", "desert", "feather", "glacier",
         "honey", "iron", "jungle", "lantern", "meadow", "ocean", "planet", "ribbon", "shadow", "thunder")
DEFAULT_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)


@struct.dataclass
class ArgmaxState:
    argmax: jax.Array  # i32[L, B, Hq] top-1 attended position of the newest query, per layer and query head


@struct.dataclass
class _ArgmaxRecorder:
    """Dense attention that records every head's top-1 attended key of the newest query (calibration only)."""

    def init_state(self, cfg, batch, max_len):
        return ArgmaxState(argmax=jnp.zeros((cfg.num_layers, batch, cfg.num_heads), jnp.int32))

    def layer_info(self, cfg):
        return None

    @staticmethod
    def _argmax(q_last, k_heads, n_valid):
        """q_last: [B, Hq, D]; k_heads: [B, Hkv, N, D]; n_valid: i32[B] -> i32[B, Hq] argmax over keys < n_valid."""
        B, Hq, D = q_last.shape
        Hkv, N = k_heads.shape[1], k_heads.shape[2]
        logits = jnp.einsum("bhgd,bhnd->bhgn", q_last.reshape(B, Hkv, Hq // Hkv, D), k_heads,
                            preferred_element_type=jnp.float32)
        logits = jnp.where(jnp.arange(N)[None, None, None] < n_valid[:, None, None, None], logits, -jnp.inf)
        return jnp.argmax(logits, axis=-1).reshape(B, Hq).astype(jnp.int32)

    def prefill(self, ctx, q, k, v, state):
        last = jnp.take_along_axis(q, (ctx.lengths - 1)[:, None, None, None], axis=1)[:, 0]  # [B, Hq, D]
        am = self._argmax(last, jnp.swapaxes(k, 1, 2), ctx.lengths)
        return dense_prefill(q, k, v), ArgmaxState(argmax=state.argmax.at[ctx.layer].set(am))

    def decode(self, ctx, q, cache, state):
        am = self._argmax(q[:, -1], cache.k, ctx.lengths)
        return dense_decode(q, cache.k, cache.v, ctx.lengths), ArgmaxState(argmax=state.argmax.at[ctx.layer].set(am))


@functools.partial(jax.jit, static_argnames=("cfg", "steps", "capacity"))
def copy_run(params, tokens, lengths, *, cfg, steps: int, capacity: int):
    """Greedy dense decoding that records attention argmaxes.

    Args:
      tokens: i32[B, T] prompts (right padded); lengths: i32[B].
    Returns:
      (gen: i32[steps, B] generated tokens, argmax: i32[steps, L, B, Hq] each head's top-1 position in the
       forward that produced gen[s]).
    """
    rec = _ArgmaxRecorder()
    B = tokens.shape[0]
    cache = init_cache(cfg, B, capacity, params.embed.dtype)
    logits, cache, st = llama.prefill(params, cfg, rec, tokens, lengths, cache, rec.init_state(cfg, B, capacity))
    tok = jnp.argmax(logits, -1).astype(jnp.int32)

    def body(carry, _):
        tok, cache = carry
        logits, cache, s = llama.decode(params, cfg, rec, tok[:, None], cache, rec.init_state(cfg, B, capacity))
        new = jnp.argmax(logits[:, 0], -1).astype(jnp.int32)
        return (new, cache), (new, s.argmax)

    _, (gen, am) = jax.lax.scan(body, (tok, cache), None, length=steps - 1)
    return jnp.concatenate([tok[None], gen]), jnp.concatenate([st.argmax[None], am])


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def special_prefix(tokenizer) -> list[int]:
    """The ids the tokenizer puts before a text when adding special tokens (e.g. [BOS]), maybe []."""
    plain = _ids(tokenizer, "Hello world")
    full = list(tokenizer("Hello world")["input_ids"])
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return full[:start]
    return []


def needle_prompt(tokenizer, filler: np.ndarray, length: int, depth: float, words: Sequence[str]):
    """One needle-copy prompt of exactly `length` tokens.

    Args:
      filler: i32[F'] filler tokens (at least the filler the length needs).
      depth: fraction of the filler before the needle, in [0, 1].
      words: the needle's words.
    Returns:
      (tokens: i32[length], needle_start, needle_ids: i32[n] the words' tokens, which the answer should copy).
    """
    prefix = special_prefix(tokenizer)
    head = prefix + _ids(tokenizer, INTRO)
    words_ids = _ids(tokenizer, " " + " ".join(words))
    needle = _ids(tokenizer, NEEDLE) + words_ids + _ids(tokenizer, ".")
    tail = _ids(tokenizer, QUESTION)
    n_fill = length - len(head) - len(needle) - len(tail)
    if n_fill < 1:
        raise ValueError(f"needle prompt length={length} (--prompt-lengths) is too short: the instructions, the "
                         f"needle of {len(words)} words (--needle-words) and the question take {length - n_fill} "
                         f"tokens; expected a length >= {length - n_fill + 1}, or fewer needle words")
    if len(filler) < n_fill:
        raise ValueError(f"filler of {len(filler)} tokens is shorter than the {n_fill} a {length}-token prompt "
                         "needs: use longer development windows (--length)")
    before = int(round(depth * n_fill))
    tokens = head + list(filler[:before]) + needle + list(filler[before:n_fill]) + tail
    start = len(head) + before + len(_ids(tokenizer, NEEDLE))
    return np.asarray(tokens, np.int32), start, np.asarray(words_ids, np.int32)


def head_scores(tokens: np.ndarray, gen: np.ndarray, argmax: np.ndarray, starts, needles) -> tuple[np.ndarray,
                                                                                                  np.ndarray]:
    """Retrieval scores of one batch.

    Args:
      tokens: i32[B, T] prompts; gen: i32[S, B] generated tokens; argmax: i32[S, L, B, Hq];
      starts: needle word start per prompt; needles: the needle word tokens per prompt (|needle_b| <= S).
    Returns:
      (scores: f64[B, L, Hq] per prompt, recall: f64[B] fraction of needle tokens reproduced in place).
    """
    S, L, B, Hq = argmax.shape
    T = tokens.shape[1]
    scores = np.zeros((B, L, Hq))
    recall = np.zeros((B,))
    for b in range(B):
        n = len(needles[b])
        j = argmax[:n, :, b]  # [n, L, Hq]
        in_needle = (j >= starts[b]) & (j < starts[b] + n)
        copied = tokens[b, np.clip(j, 0, T - 1)] == gen[:n, b][:, None, None]
        scores[b] = (in_needle & copied).sum(axis=0) / n
        recall[b] = float(np.mean(gen[:n, b] == needles[b]))
    return scores, recall


def calibrate(model, windows: np.ndarray, *, lengths: Sequence[int], depths: Sequence[float] = DEFAULT_DEPTHS,
              needle_words: int = 8, min_recall: float = 0.5, seed: int = 0, fingerprint: str = "",
              progress=None) -> Artifact:
    """Detects retrieval heads on needle-copy prompts made from `windows` (i32[S, T] filler) and the tokenizer."""
    cfg, params, tok = model.cfg, model.params, model.tokenizer
    windows = np.asarray(windows, np.int32)
    if windows.ndim != 2 or len(windows) == 0:
        raise ValueError(f"windows has shape {windows.shape}: expected i32[S >= 1, T] development windows")
    if not 0.0 < min_recall <= 1.0:
        raise ValueError(f"min_recall={min_recall}: expected a fraction in (0, 1]")
    if not 1 <= needle_words <= len(WORDS):
        raise ValueError(f"needle_words={needle_words}: expected between 1 and {len(WORDS)}")
    for d in depths:
        if not 0.0 <= d <= 1.0:
            raise ValueError(f"depth {d}: expected a fraction in [0, 1]")
    skip = len(special_prefix(tok))
    rng = np.random.default_rng(seed)
    # Every prompt is built (tokenizing only) before any runs: one past the model's context is refused before the
    # work. The answer's |needle| tokens are decoded after the prompt, the last from the token at position
    # length + |needle| - 2, which must lie in the context (RoPE past it only extrapolates, without a word).
    batches = []  # per window, per length: (length, steps, rows, starts, needles)
    for w in windows:
        filler = w[skip:]
        batches.append([])
        for length in lengths:
            rows, starts, needles = [], [], []
            for depth in depths:
                words = list(rng.choice(WORDS, size=needle_words, replace=False))
                t, s, n = needle_prompt(tok, filler, length, depth, words)
                rows.append(t)
                starts.append(s)
                needles.append(n)
            steps = max(len(n) for n in needles)
            if length + steps - 1 > cfg.max_position_embeddings:
                raise ValueError(f"needle prompt length={length} (--prompt-lengths, default --length/2 and --length) "
                                 f"and the {steps} needle tokens decoded after it pass the model's context of "
                                 f"{cfg.max_position_embeddings} tokens: expected lengths <= "
                                 f"{cfg.max_position_embeddings + 1 - steps}, or fewer needle words")
            batches[-1].append((length, steps, rows, starts, needles))
    all_scores, all_recall = [], []
    for window_batches in batches:
        for length, steps, rows, starts, needles in window_batches:
            capacity = -(-(length + steps) // 128) * 128
            tokens = np.stack(rows)
            gen, am = copy_run(params, jnp.asarray(tokens), jnp.full((len(rows),), length, jnp.int32), cfg=cfg,
                               steps=steps, capacity=capacity)
            sc, rc = head_scores(tokens, np.asarray(gen), np.asarray(am), starts, needles)
            all_scores.append(sc)
            all_recall.append(rc)
        if progress is not None:
            progress(1)
    scores = np.concatenate(all_scores)  # [P, L, Hq]
    recall = np.concatenate(all_recall)
    ok = recall >= min_recall
    mean = scores[ok].mean(axis=0) if ok.any() else scores.mean(axis=0)
    if not ok.any():
        warnings.warn(f"no needle prompt of {len(recall)} reached min_recall={min_recall:g} (mean recall "
                      f"{float(recall.mean()):.3f}): the head scores are the mean over every prompt, which may not "
                      "find retrieval heads; expected a lower --min-recall, more prompts or other lengths/depths",
                      stacklevel=2)
    n_default = max(1, int(round(DEFAULT_HEAD_FRACTION * cfg.num_layers * cfg.num_heads)))
    heads = top_heads(mean, n_default)
    return Artifact(kind=ARTIFACT_KIND, fingerprint=fingerprint,
                    arrays={"scores": mean.astype(np.float32), "recall": recall.astype(np.float32)},
                    meta={"model": getattr(model, "name", ""), "prompts": int(len(recall)),
                          "retrieved_prompts": int(ok.sum()), "fallback": None if ok.any() else "all prompts",
                          "mean_recall": float(recall.mean()), "lengths": list(lengths), "depths": list(depths),
                          "needle_words": needle_words, "min_recall": min_recall,
                          "retrieval_heads": [list(h) for h in heads],
                          "retrieval_head_scores": [float(mean[h]) for h in heads]})


def add_arguments(p) -> None:
    p.add_argument("--prompt-lengths", default=None,
                   help="comma-separated needle prompt lengths in tokens, each between 64 and --length (default: "
                        "--length/2 and --length)")
    p.add_argument("--depths", default=",".join(f"{d:g}" for d in DEFAULT_DEPTHS),
                   help="needle depths, fractions in [0, 1] (default 0.1,0.3,0.5,0.7,0.9)")
    p.add_argument("--needle-words", type=int, default=8, help="random words in the needle (default 8)")
    p.add_argument("--min-recall", type=float, default=0.5,
                   help="a prompt counts when at least this fraction of the needle is copied back (default 0.5)")


def _cli_lengths_depths(args, T: int) -> tuple[list[int], list[float]]:
    """The needle prompt lengths and depths of the flags, checked (T: the windows' length, --length)."""
    if args.prompt_lengths is not None:
        try:
            lengths = [int(x) for x in args.prompt_lengths.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--prompt-lengths {args.prompt_lengths!r}: expected comma-separated integers") from None
        if not lengths:
            raise ValueError(f"--prompt-lengths {args.prompt_lengths!r}: expected at least one length")
    else:
        if T < 128:
            raise ValueError(f"--length {T}: the default needle prompts are --length/2 and --length tokens, each at "
                             "least 64: expected --length >= 128, or --prompt-lengths")
        lengths = sorted({T // 2, T})
    for n in lengths:
        if not 64 <= n <= T:
            raise ValueError(f"--prompt-lengths value {n}: expected between 64 and --length {T}")
    try:
        depths = [float(x) for x in args.depths.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--depths {args.depths!r}: expected comma-separated fractions in [0, 1]") from None
    if not depths:
        raise ValueError(f"--depths {args.depths!r}: expected at least one needle depth in [0, 1]")
    for d in depths:
        if not 0.0 <= d <= 1.0:  # (NaN fails too)
            raise ValueError(f"--depths value {d:g}: expected fractions in [0, 1]")
    if not 1 <= args.needle_words <= len(WORDS):
        raise ValueError(f"--needle-words {args.needle_words}: expected between 1 and {len(WORDS)} (the words "
                         "drawn without repetition)")
    if not 0.0 < args.min_recall <= 1.0:
        raise ValueError(f"--min-recall {args.min_recall:g}: expected a fraction in (0, 1]")
    return lengths, depths


def check_cli(args) -> None:
    """The flags' checks that need no model (before it loads)."""
    _cli_lengths_depths(args, args.length)


def run_cli(model, windows, args, progress=None) -> Artifact:
    from jsparse.artifacts import fingerprint

    lengths, depths = _cli_lengths_depths(args, int(np.asarray(windows).shape[1]))
    return calibrate(model, windows, lengths=lengths, depths=depths, needle_words=args.needle_words,
                     min_recall=args.min_recall, seed=args.seed, fingerprint=fingerprint(model), progress=progress)


register_calibration("evosparse", add_arguments, run_cli, check=check_cli,
                     help="EvoSparse: retrieval heads by needle copying (every head's score; the method takes the top)")
