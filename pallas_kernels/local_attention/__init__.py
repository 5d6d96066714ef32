"""Causal sliding-window attention with attention sinks (TSA's fill for dropped rows); see api.py."""

from pallas_kernels.local_attention.api import IMPLEMENTATIONS, default_implementation, local_attention
from pallas_kernels.local_attention.gpu import BlockSizes, local_attention_gpu
from pallas_kernels.local_attention.reference import banded_mask, local_attention_reference
from pallas_kernels.local_attention.tpu import local_attention_tpu

__all__ = ["BlockSizes", "IMPLEMENTATIONS", "banded_mask", "default_implementation", "local_attention",
           "local_attention_gpu", "local_attention_reference", "local_attention_tpu"]
