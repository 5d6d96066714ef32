"""`jsparse eval` with a draft: passkey by speculative decoding (acceptance rate in the records), STS next to
dense on identical prompts (full budget: same answers, same perplexity), and the spec's errors."""

import numpy as np
import pytest

from eval import harness
from eval.report import summary_markdown
from jsparse.api import keep_layers
from test_eval import corpus, model, tokenizer  # noqa: F401  (fixtures)


def test_eval_sts_full_budget_matches_dense(model, corpus):  # noqa: F811
    draft = keep_layers(model, [0])
    cfg = model.cfg
    head_map = np.stack(np.meshgrid(np.zeros(cfg.num_layers, int), np.arange(cfg.num_heads), indexing="ij"), -1)
    spec = harness.EvalSpec(methods=("dense", "sts"), tasks=("passkey", "ppl"), lengths=(160,), samples=2,
                            corpus=corpus, ppl_variants=("prefill", "continuation"), continuation=37, new_tokens=6,
                            draft=draft, gamma=2,
                            method_options={"sts": {"head_map": head_map, "budget": 1.0, "tile": 16}})
    run = harness.evaluate(model, spec, progress=False)
    main = {(r["method"], r["task"], r["variant"]): r for r in run.records if r["depth"] is None}
    for m in ("dense", "sts"):
        rate = main[(m, "passkey", "generate")]["acceptance_rate"]
        assert rate is not None and 0.0 <= rate <= 1.0
        assert main[(m, "ppl", "prefill")]["acceptance_rate"] is None
    for variant in ("prefill", "continuation"):  # STS-P; STS-D as teacher-forced rounds (37 = 12 rounds of 3, + 1)
        np.testing.assert_allclose(main[("sts", "ppl", variant)]["value"], main[("dense", "ppl", variant)]["value"],
                                   rtol=1e-4)
    answers = {m: [o["completion"] for o in run.outputs if o["method"] == m] for m in ("dense", "sts")}
    assert answers["sts"] == answers["dense"]
    assert "acceptance rate" in summary_markdown(run.records)


def test_eval_sts_spec_errors(model):  # noqa: F811
    with pytest.raises(ValueError, match="needs a draft model"):
        harness.EvalSpec(methods=("sts",), tasks=("passkey",)).validate()
    with pytest.raises(ValueError, match="ppl variants \\['prefill', 'continuation'\\] only"):
        harness.EvalSpec(methods=("sts",), tasks=("ppl",), draft=model).validate()
    with pytest.raises(ValueError, match="gamma=0"):
        harness.EvalSpec(methods=("dense",), gamma=0).validate()
