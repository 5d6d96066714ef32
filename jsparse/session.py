"""Multi-turn conversations with speculative decoding (and STS): both KV caches live across turns.

    session = jsparse.Session(model, draft, method=sts, gamma=4, capacity=8192)
    reply = session.send_ids(first_message_ids, max_new_tokens=128)   # prefill (STS-P) + rounds (STS-D)
    reply = session.send_ids(next_message_ids, max_new_tokens=128)    # appended on top of both caches

The first message is prefilled by both models; every later message is appended at the end of both caches (one
forward of the message's tokens per model, the draft first so STS selects the target's keys from the draft's
attention over the new tokens), and nothing earlier is recomputed. The last token of a reply (often the EOS)
is written at the start of the next message, so the caches always hold the whole conversation.

On a mesh (both models loaded with the same `mesh=`, e.g. `model=8`), every step runs sharded: both caches by KV
heads, both models' kernels per shard, STS's draft rows gathered across `model` (`models.speculative`). A session is
one conversation (batch 1), so the mesh's data axis must be 1.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jsparse.artifacts import check_calibrated_for
from models import sharding
from models.bundled import LoadedModel
from models.generate import (NEW_TOKENS_BUCKET, check_capacity_fits, check_count, check_token_ids, round_up,
                             seed_key)
from models.speculative import append_step, check_heads_on_mesh, loop_step, prefill_step


class Session:
    """A conversation of one row (batch 1) between a user and a target model with a speculative draft.

    Args:
      model, draft: target and draft (same vocabulary, on the same mesh or neither on one); method: the
        target's method ("dense", "sts" or a method object; STS builds its draft's recorder itself); gamma: draft
        tokens per round; capacity: cache rows of each model (the whole conversation plus gamma + 1 must fit;
        None: the smaller of the model's context and 4096, rounded up to 128 (a block or page method needs a
        capacity its block divides; the conversation stays within the context), and, on a model with a sliding
        window W whose method does not honour windows (`jsparse.window_methods()`), W rounded down to whole blocks
        of 128 (else 16, else 1) rows (`api.window_capacity`), as `generate` caps it; a capacity above such a W is
        refused);
        temperature, top_p, seed: sampling. Each turn draws with keys split from the session's key, which
        advances once per successful turn: a turn refused before its step runs leaves the key and the
        conversation as they were, so retrying it samples as if it had not failed (one that fails after the old
        cache was donated marks the session lost).
    """

    def __init__(self, model: LoadedModel, draft: LoadedModel, *, method: Any = "dense", gamma: int = 4,
                 capacity: int | None = None, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0):
        from jsparse.api import check_draft, eos_ids, fit_windows, sampling_of, speculative_methods

        check_draft(model, draft, gamma)
        self.mesh = model.mesh
        if self.mesh is not None:
            data = sharding.mesh_size(self.mesh, "data")
            if data != 1:
                raise sharding.ShardingError(
                    f"a Session holds one conversation (batch 1) and its mesh has a data axis of {data}: expected "
                    "data=1 (shard a session over model= only; batches of prompts go through generate)")
            check_heads_on_mesh(model.cfg, draft.cfg, self.mesh, "a Session on a mesh")
        self.model, self.draft, self.gamma = model, draft, gamma
        if capacity is not None:
            capacity = check_count("capacity", capacity, "cache rows; None: the model's context, at most 4096, rounded up to 128")
            check_capacity_fits(model.cfg, capacity, verify_rows=gamma + 1)
        self.t_method, self.d_method = speculative_methods(method, model, draft, gamma)
        check_calibrated_for(self.t_method, model)
        # A method that does not honour a model's sliding window: the default capacity is cut to W's whole blocks (as
        # generate's) and a larger one is refused (the window would bind once the conversation passed it).
        chosen, capacity = capacity, capacity or round_up(min(model.cfg.max_position_embeddings, 4096), 128)
        self.capacity = fit_windows(((model, self.t_method), (draft, self.d_method)), chosen or 0, capacity,
                                    capped=chosen is None, asked=f"capacity={chosen}")
        if gamma + 3 > self.capacity:  # a one-token message, one new token and the gamma + 1 verification rows
            raise ValueError(f"gamma={gamma}: a round's gamma + 1 = {gamma + 1} verification rows after a one-token "
                             f"message and reply need {gamma + 3} cache rows, more than the session's capacity of "
                             f"{self.capacity}: expected a smaller gamma or a larger capacity")
        self.key = seed_key(seed)  # (checks the seed first)
        self.sampling = sampling_of(temperature, top_p, seed)
        self.eos = eos_ids(model)
        self.state = None
        self.lost = None  # why the conversation's cache is gone (a step failed after its state was donated)
        self.tokens: list[int] = []  # the conversation so far (messages and replies)
        self.rounds = 0
        self.accepted = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / proposed ones, over the session's rounds."""
        return self.accepted / max(self.rounds * self.gamma, 1)

    def send_ids(self, ids: Sequence[int], max_new_tokens: int = 64) -> list[int]:
        """Adds a message (token ids) and returns the reply's tokens (EOS included when one was generated)."""
        if self.lost is not None:
            raise RuntimeError(f"this session's cache was lost when an earlier step failed ({self.lost}): start a new "
                               "Session")
        check_token_ids(self.model.cfg, [ids], "the message")  # integers (5.7 is refused, not read as 5), in range
        if len(ids) == 0:
            raise ValueError("empty message: expected at least one token")
        max_new_tokens = check_count("max_new_tokens", max_new_tokens)
        ids = [int(t) for t in ids]
        total = len(self.tokens) + len(ids) + max_new_tokens
        for who, m in (("model", self.model), ("draft", self.draft)):
            if total > m.cfg.max_position_embeddings:
                raise ValueError(f"the conversation ({len(self.tokens)} tokens) plus this message ({len(ids)}) and "
                                 f"max_new_tokens={max_new_tokens} is {total} tokens, longer than the {who}'s "
                                 f"context of {m.cfg.max_position_embeddings}")
        need = len(self.tokens) + len(ids) + max_new_tokens + self.gamma + 1
        if need > self.capacity:
            raise ValueError(f"the conversation ({len(self.tokens)} tokens) plus this message ({len(ids)}) and "
                             f"max_new_tokens={max_new_tokens} (+ gamma + 1 = {self.gamma + 1} verification rows) "
                             f"need {need} cache rows, more than the session's capacity of {self.capacity}")
        m, d = self.model, self.draft
        common = dict(t_cfg=m.cfg, d_cfg=d.cfg, sampling=self.sampling)
        next_key, k1, k2 = jax.random.split(self.key, 3)  # stored with the rest once the step succeeded
        # The message right-padded to its 64-token bucket (one compilation serves the bucket), within the rows the
        # cache has left: a later message's padding rows are decoded past the conversation, then rolled back (an
        # STS draft leaves them out of the record its target selects by).
        from jsparse.api import pad_batch

        later = self.state is not None
        msg, length = pad_batch([ids], limit=self.capacity - (len(self.tokens) + 1 if later else 0))
        msg, length = jnp.asarray(msg), jnp.asarray(length)
        if self.mesh is not None:
            msg = sharding.shard_batch(msg, self.mesh)
            length = sharding.shard_batch(length, self.mesh)
        # The session changes only once the whole step has succeeded: a step refused while it is traced (before
        # anything runs) leaves it as it was; one that fails after the old state was donated marks it lost.
        try:
            with sharding.use_mesh(self.mesh):
                if self.state is None:
                    state = prefill_step(m.params, d.params, self.t_method, self.d_method, msg, length, k1,
                                         capacity=self.capacity, **common)
                else:
                    state = append_step(m.params, d.params, self.t_method, self.d_method, self.state, msg, k1,
                                        length, **common)
                # The loop's width in buckets (NEW_TOKENS_BUCKET), the reply's count traced: one compilation
                # serves every max_new_tokens of a bucket.
                out, num, rounds, accepted, state = loop_step(
                    m.params, d.params, self.t_method, self.d_method, state, k2, gamma=self.gamma,
                    max_new_tokens=round_up(max_new_tokens, NEW_TOKENS_BUCKET), eos_ids=self.eos,
                    row_new_tokens=jnp.full((1,), max_new_tokens, jnp.int32), **common)
            reply = [int(t) for t in np.asarray(out)[0, : int(num[0])]]
        except BaseException as e:
            if self.state is not None and any(x.is_deleted() for x in jax.tree_util.tree_leaves(self.state)
                                              if isinstance(x, jax.Array)):
                self.state, self.lost = None, f"{type(e).__name__}: {e}"
            raise
        self.state, self.key = state, next_key
        self.rounds += int(rounds[0])
        self.accepted += int(accepted[0])
        self.tokens += ids + reply
        return reply

    def send(self, text: str, max_new_tokens: int = 64) -> str:
        """Adds a message given as raw text (no chat template: format turns yourself, e.g. with the tokenizer's
        chat markers; the first message is tokenized with the tokenizer's special tokens, such as a BOS it adds,
        later ones without) and returns the reply's text."""
        if not isinstance(text, str) or not text:
            raise ValueError(f"text={text!r:.60}: expected a non-empty str (token ids go to `send_ids`)")
        tok = self.model.tokenizer
        if tok is None:
            raise ValueError(f"model {getattr(self.model, 'name', '?')!r} has no tokenizer (a Hugging Face folder "
                             "without tokenizer files): pass token ids to `send_ids`, or load a folder with its "
                             "tokenizer")
        ids = tok(text, add_special_tokens=not self.tokens)["input_ids"]
        reply = self.send_ids(ids, max_new_tokens)
        return tok.decode([t for t in reply if t not in self.eos], skip_special_tokens=True)
