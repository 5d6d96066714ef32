"""Gathered sparse attention (decode and tile-gathered prefill): reference, XLA, Pallas GPU and TPU kernels."""
