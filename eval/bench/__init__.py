"""Benchmarks behind `jsparse bench NAME`: one module per benchmark, sharing `common` (timing, device facts, JSON)."""
