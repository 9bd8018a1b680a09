#!/usr/bin/env python3
"""The TFLOP/s sweep of PERFORMANCE.md: every mhattn backend beside sdpa-flash, sdpa-cudnn, sdpa-efficient
and the naive reference; forward, backward and forward+backward; d 64/128/256; N 512..16k; causal or not.

    python3 benchmarks/bench_attention.py                       # bf16, the full protocol
    python3 benchmarks/bench_attention.py --quick --json out.json --plot-dir plots
    python3 benchmarks/bench_attention.py --dtype bf16,fp16 --impl triton,sdpa-flash --head-dim 128

Every option of `mhattn bench` applies (see --help); this is `mhattn bench` with the same arguments.
"""

import sys

from mhattn.cli import main

if __name__ == "__main__":
    sys.argv = [sys.argv[0], "bench", *sys.argv[1:]]
    sys.exit(main(sys.argv[1:]))
