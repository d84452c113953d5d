"""Benchmarks for gpu-share: run `python -m benchmarks.run` (see docs/performance.md)."""
