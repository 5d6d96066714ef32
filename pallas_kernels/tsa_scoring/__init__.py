"""Token Sparse Attention key scoring (issue 5, build item 1).

`tsa_scores(q, k, *, window, pool_kernel, lengths, implementation)` -> f32[B, Hq, T]: the mean softmax
probability that the last W queries give each key, average-pooled over keys. Modules: `reference` (the
jnp spec), `gpu` (Pallas Triton), `tpu` (Pallas Mosaic), `common` (checks, window gather, pooling), `api`.
"""

from pallas_kernels.tsa_scoring.api import default_implementation, tsa_scores
from pallas_kernels.tsa_scoring.common import avg_pool_keys
from pallas_kernels.tsa_scoring.reference import tsa_mean_probs_reference, tsa_scores_reference

__all__ = [
    "avg_pool_keys",
    "default_implementation",
    "tsa_mean_probs_reference",
    "tsa_scores",
    "tsa_scores_reference",
]
