"""Benchmarks for mlx_serve: load generator, engine-limit harness and the A/B runner.

Run from the repository root, e.g. ``python -m benchmarks.ab --quick``; see README.md.
"""
