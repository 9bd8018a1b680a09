"""FlashAttention-2 in Triton: forward.py (the forward kernel), backward.py (preprocess, dK/dV, dQ),
scores.py (the score tile both share), rng.py (the dropout RNG), configs.py (tiles per GPU, dtype,
head dim and causality) and backend.py (the backend contract around them). decode.py holds the split-KV
decoding kernels (decode_launch.py launches them, for KV caches and few query rows); varlen_launch.py runs
the FlashAttention-2 kernels over packed sequences; key_padding.py turns key padding masks into key bounds."""

from mhattn.backends.triton.backend import TritonBackend

__all__ = ["TritonBackend"]
