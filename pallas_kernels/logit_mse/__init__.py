"""TokenButler's blockwise logit-MSE loss: reference (reference.py), Pallas GPU (gpu.py) and TPU
(tpu.py) kernels, and the differentiable entry point ``logit_mse`` (api.py)."""

from pallas_kernels.logit_mse.api import IMPLEMENTATIONS, logit_mse
from pallas_kernels.logit_mse.reference import logit_mse_reference, num_pairs

__all__ = ["IMPLEMENTATIONS", "logit_mse", "logit_mse_reference", "num_pairs"]
