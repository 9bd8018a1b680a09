#!/usr/bin/env python3
"""Peak extra memory of one forward+backward against N (causal, B=1, H=16, d=128, bf16, N = 1k..32k) for
every implementation, up to the largest N that fits: O(N) kernels against the O(N^2) reference.

    python3 benchmarks/bench_memory.py
    python3 benchmarks/bench_memory.py --memory-seqlen 8k,32k --impl triton,sdpa-flash

This is `mhattn bench --no-sweep --memory` with the arguments given.
"""

import sys

from mhattn.cli import main

if __name__ == "__main__":
    sys.argv = [sys.argv[0], "bench", "--no-sweep", "--memory", *sys.argv[1:]]
    sys.exit(main(sys.argv[1:]))
