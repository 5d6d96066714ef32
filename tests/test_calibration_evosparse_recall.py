"""EvoSparse calibration averages the head scores over the prompts where the model retrieved the needle: "at least
`min_recall` of the needle tokens reproduced" (evosparse_calibration docstring and --min-recall help). A prompt whose
recall equals min_recall counts. The suite never had a prompt on the boundary, so `>` for `>=` went unnoticed (with a
needle of 8 tokens and the default 0.5, a prompt copying 4 of them would be dropped, or every prompt averaged)."""

import numpy as np

from jsparse.methods import evosparse_calibration as ecal
from models.config import ModelConfig

CFG = ModelConfig(architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=512)


def test_a_prompt_at_exactly_min_recall_counts(monkeypatch):
    L, H = CFG.num_layers, CFG.num_heads
    # Prompt 0 copies half its needle (recall 0.5 == min_recall), prompt 1 a quarter.
    outcomes = iter([(np.ones((1, L, H)), np.array([0.5])), (np.zeros((1, L, H)), np.array([0.25]))])
    monkeypatch.setattr(ecal, "special_prefix", lambda tok: [])
    monkeypatch.setattr(ecal, "needle_prompt",
                        lambda tok, filler, length, depth, words: (np.zeros(length, np.int32), 10,
                                                                   np.arange(4, dtype=np.int32)))
    monkeypatch.setattr(ecal, "copy_run", lambda params, tokens, lengths, *, cfg, steps, capacity: (
        np.zeros((steps, tokens.shape[0]), np.int32), np.zeros((steps, L, tokens.shape[0], H), np.int32)))
    monkeypatch.setattr(ecal, "head_scores", lambda tokens, gen, am, starts, needles: next(outcomes))

    class Model:
        cfg, params, tokenizer, name = CFG, None, None, "stub"

    art = ecal.calibrate(Model, np.zeros((2, 64), np.int32), lengths=[64], depths=[0.5], min_recall=0.5)
    assert art.meta["retrieved_prompts"] == 1 and art.meta["fallback"] is None
    np.testing.assert_allclose(art.arrays["scores"], np.ones((L, H)))  # the retrieving prompt's scores alone
    np.testing.assert_allclose(art.arrays["recall"], [0.5, 0.25])
