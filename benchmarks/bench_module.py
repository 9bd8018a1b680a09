#!/usr/bin/env python3
"""A training step of a 12-layer Transformer encoder (d_model 768, 12 heads, bf16 autocast, AdamW) with
torch.nn.MultiheadAttention against mhattn.MultiheadAttention: tokens per second and peak memory, N 1k..8k.

    python3 benchmarks/bench_module.py
    python3 benchmarks/bench_module.py --module-seqlen 1k,4k --module-variant torch,mhattn:triton

This is `mhattn bench --no-sweep --module` with the arguments given.
"""

import sys

from mhattn.cli import main

if __name__ == "__main__":
    sys.argv = [sys.argv[0], "bench", "--no-sweep", "--module", *sys.argv[1:]]
    sys.exit(main(sys.argv[1:]))
