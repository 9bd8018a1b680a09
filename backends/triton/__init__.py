"""FlashAttention-2 in Triton: forward.py (the forward kernel), backward.py (preprocess, dK/dV, dQ),
scores.py (the score tile both share), rng.py (the dropout RNG), configs.py (tiles per GPU, dtype,
head dim and causality) and backend.py (the backend contract around them)."""

from mhattn.backends.triton.backend import TritonBackend

__all__ = ["TritonBackend"]
