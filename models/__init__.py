"""Flax Llama-family models, KV cache, checkpoint converters and the bundled model."""
