"""Benchmarks against PyTorch SDPA backends (engine behind `mhattn bench`)."""
