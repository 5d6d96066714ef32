"""Co-reference retrieval (TokenButler's task): a location introduced early, distractor passages, then a question
that needs the location again.

The prompt is a raw completion assembled in token space to exactly `length` tokens:

    [special prefix] INSTRUCTION  INTRO  BODY  QUESTION

  INSTRUCTION  "Read the story and answer the question."
  INTRO        "{name} put the {object} in the {location}."        (the span scored for coverage: {location})
  BODY         filler sentences (FILLER pool) with a distractor fact "{other name} put the {other object} in the
               {other location}." every ~1/8 of the body; distractors never reuse the target's name, object or
               location
  QUESTION     "\n\nQuestion: Where did {name} put the {object}?\nAnswer: {name} put the {object} in the"

The answer is correct when the completion starts with the location (case-insensitive, after leading spaces).

Protocol (`run_coref`): the method prefills INSTRUCTION..BODY (its prefill), then decodes the QUESTION one token at a
time (its decode: every question token selects its own keys) and generates `new_tokens` answer tokens greedily.
Rows of a batch have questions of different lengths; each row feeds its own question tokens, then its own
generated tokens, so one compiled decode step serves the whole run.

All names, objects, locations and filler sentences are this module's own pools; the draws depend only on
(seed, length, sample), so every method sees the same prompts.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from eval.passkey import special_prefix
from models import llama
from models.cache import init_cache
from models.generate import round_up

INSTRUCTION = "Read the story and answer the question."
INTRO = "{name} put the {object} in the {location}."
FACT = "{name} put the {object} in the {location}."
QUESTION = "\n\nQuestion: Where did {name} put the {object}?\nAnswer: {name} put the {object} in the"

NAMES = ("Mara", "Tomas", "Elena", "Victor", "Nadia", "Oscar", "Ingrid", "Felix", "Clara", "Hugo", "Lena", "Arthur",
         "Rosa", "Edgar", "Sofia", "Walter", "Greta", "Milo", "Alice", "Bruno")
OBJECTS = ("brass key", "silver locket", "red notebook", "old map", "wooden flute", "blue scarf", "glass jar",
           "leather wallet", "pocket watch", "green umbrella", "clay pot", "violin case", "iron lantern",
           "paper kite", "copper kettle", "straw hat", "velvet box", "chess set", "fishing rod", "music box")
LOCATIONS = ("attic", "greenhouse", "cellar", "lighthouse", "stable", "chapel", "bakery", "orchard", "windmill",
             "pantry", "boathouse", "library", "garage", "workshop", "barn", "garden", "kitchen", "basement",
             "museum", "tower")
FILLER = (
    "The morning was cold and grey, and the fog lay low over the fields.",
    "A cart rolled slowly along the road toward the next village.",
    "Somebody was singing in the street, but the words were lost in the wind.",
    "The river ran high after three days of steady rain.",
    "Smoke rose from the chimneys and drifted over the roofs.",
    "The market square was crowded with traders and their customers.",
    "Dogs barked in the distance, and then everything was quiet.",
    "The clock on the town hall struck the hour.",
    "A group of children chased each other around the fountain.",
    "The baker was already awake, and the smell of bread filled the lane.",
    "Two old friends sat on a bench and talked about the harvest.",
    "The postman walked his usual round with a heavy bag.",
    "Clouds gathered in the west as the afternoon went on.",
    "A heron stood very still at the edge of the pond.",
    "The school bell rang, and the yard emptied in a moment.",
    "Lamps were lit one after another along the main street.",
    "The wind turned cold, and people buttoned their coats.",
    "A letter arrived from the city, full of news and questions.",
    "The ferry crossed the bay twice before noon.",
    "Nobody remembered when the old bridge had been built.",
    "The carpenter hammered away at a new door for the inn.",
    "A thin moon hung over the hills after sunset.",
    "The teacher read a long poem aloud to the class.",
    "Rain drummed on the roof of the station all evening.",
    "The neighbours argued cheerfully about the weather.",
    "A small dog followed the milkman from house to house.",
    "The church choir practised the same hymn again and again.",
    "Leaves blew across the square and gathered by the wall.",
    "The innkeeper counted the coins twice before closing.",
    "An owl called from the woods beyond the mill.",
)


@dataclasses.dataclass(frozen=True)
class CorefPrompt:
    """One sample.

    Attributes:
      tokens: i32[length] the whole prompt. context_len: tokens before the question (prefilled); the question is
        tokens[context_len:]. answer: the location. span: (start, end) token positions of the location in INTRO.
      name, object: the target's name and object; distractors: how many distractor facts the body holds.
    """

    tokens: np.ndarray
    context_len: int
    answer: str
    span: tuple[int, int]
    name: str
    object: str
    distractors: int


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def make_prompt(tokenizer, length: int, rng: np.random.Generator, num_distractors: int = 8) -> CorefPrompt:
    """A prompt of exactly `length` tokens (see the module docstring)."""
    name, other_names = _pick(rng, NAMES)
    obj, other_objs = _pick(rng, OBJECTS)
    loc, other_locs = _pick(rng, LOCATIONS)
    head = special_prefix(tokenizer) + _ids(tokenizer, INSTRUCTION + "\n\n")
    before, after = INTRO.split("{location}")
    intro_a = _ids(tokenizer, before.format(name=name, object=obj).rstrip())
    intro_loc = _ids(tokenizer, " " + loc)
    intro_b = _ids(tokenizer, after)
    question = _ids(tokenizer, QUESTION.format(name=name, object=obj))
    body_tokens = length - len(head) - len(intro_a) - len(intro_loc) - len(intro_b) - len(question)
    if body_tokens < 64:
        raise ValueError(f"coref length={length} is too short: expected at least "
                         f"{length - body_tokens + 64} tokens with this tokenizer")
    facts = [_ids(tokenizer, " " + FACT.format(name=n, object=o, location=l))
             for n, o, l in zip(rng.permutation(other_names), rng.permutation(other_objs),
                                rng.permutation(other_locs))][:num_distractors]
    sentences = [_ids(tokenizer, " " + s) for s in FILLER]
    body: list[int] = []
    next_fact = body_tokens // (len(facts) + 1)
    placed = 0
    while len(body) < body_tokens:
        if placed < len(facts) and len(body) >= next_fact * (placed + 1):
            body += facts[placed]
            placed += 1
        else:
            body += sentences[int(rng.integers(len(sentences)))]
    body = body[:body_tokens]
    span_start = len(head) + len(intro_a)
    tokens = head + intro_a + intro_loc + intro_b + body + question
    assert len(tokens) == length, (len(tokens), length)
    return CorefPrompt(tokens=np.asarray(tokens, np.int32), context_len=length - len(question), answer=loc,
                       span=(span_start, span_start + len(intro_loc)), name=name, object=obj, distractors=placed)


def _pick(rng: np.random.Generator, pool: Sequence[str]) -> tuple[str, list[str]]:
    i = int(rng.integers(len(pool)))
    return pool[i], [p for j, p in enumerate(pool) if j != i]


def make_prompts(tokenizer, length: int, samples: int, seed: int = 0) -> list[CorefPrompt]:
    if samples < 1:
        raise ValueError(f"samples={samples}: expected >= 1")
    return [make_prompt(tokenizer, length, np.random.default_rng([seed, length, i])) for i in range(samples)]


def is_correct(completion: str, answer: str) -> bool:
    return completion.lstrip().lower().startswith(answer.lower())


@functools.partial(jax.jit, static_argnames=("cfg", "capacity"))
def _prefill(params, method, tokens, lengths, *, cfg, capacity):
    B = tokens.shape[0]
    cache = init_cache(cfg, B, capacity, params.embed.dtype)
    state = method.init_state(cfg, B, capacity)
    _, cache, state = llama.prefill(params, cfg, method, tokens, lengths, cache, state)
    return cache, state


@functools.partial(jax.jit, static_argnames=("cfg",))
def _step(params, method, tokens, cache, state, *, cfg):
    logits, cache, state = llama.decode(params, cfg, method, tokens, cache, state)
    return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), cache, state


def run_coref(model, method, prompts: Sequence[CorefPrompt], new_tokens: int = 4, rows: int = 4) -> list[str]:
    """Greedy completions of the prompts under `method` (prefill the context, decode the question token by token,
    then generate), `rows` prompts per batch (the last batch padded by repeating a prompt)."""
    cfg, params = model.cfg, model.params
    length = len(prompts[0].tokens)
    if any(len(p.tokens) != length for p in prompts):
        raise ValueError("coref prompts of one run must share a length")
    q_lens = [length - p.context_len for p in prompts]
    capacity = round_up(length + max(q_lens) - min(q_lens) + new_tokens, 128)  # shortest question runs longest
    completions: list[str] = []
    for s in range(0, len(prompts), rows):
        part = list(prompts[s:s + rows])
        valid = len(part)
        part += [part[-1]] * (rows - valid)
        ctx = np.zeros((rows, length), np.int32)
        for b, p in enumerate(part):
            ctx[b, :p.context_len] = p.tokens[:p.context_len]
        lengths = np.array([p.context_len for p in part], np.int32)
        cache, state = _prefill(params, method, jnp.asarray(ctx), jnp.asarray(lengths), cfg=cfg, capacity=capacity)
        questions = [p.tokens[p.context_len:] for p in part]
        steps = max(len(q) for q in questions) + new_tokens - 1
        out = [[] for _ in part]
        prev = np.zeros((rows,), np.int32)
        for t in range(steps):
            feed = np.array([q[t] if t < len(q) else prev[b] for b, q in enumerate(questions)], np.int32)
            nxt, cache, state = _step(params, method, jnp.asarray(feed[:, None]), cache, state, cfg=cfg)
            prev = np.asarray(nxt)
            for b, q in enumerate(questions):
                if t >= len(q) - 1 and len(out[b]) < new_tokens:
                    out[b].append(int(prev[b]))
        for b in range(valid):
            completions.append(model.tokenizer.decode(out[b], skip_special_tokens=True))
    return completions
