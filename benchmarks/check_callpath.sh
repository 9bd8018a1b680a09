#!/usr/bin/env bash
# GPU check of the call path (issue 11), a few minutes on an H100, from the repo root:
#   source benchmarks/device_env.sh && bash benchmarks/check_callpath.sh
# 1. the call-path tests (CUDA generator seeds, CUDA-graph replays drawing fresh dropout masks, every backend
#    drawing the same mask) and the GPU dropout tests of both kernel families;
# 2. mhattn bench --latency beside sdpa-default (per-call GPU and host-loop time, forward and
#    forward+backward, at the four small shapes); the table is printed last.
# Logs under $OUT (default /tmp/mhattn_callpath): tests.log, latency.log, latency.json, latency.txt.

set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/mhattn_callpath}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

timeout 150 python3 -m pytest -q -x tests/test_call_path.py tests/test_functional.py tests/test_dispatch.py \
    "tests/test_triton_backend.py::test_gpu_dropout_bits_and_keep_mask" \
    -k "not info_says" > "$OUT/tests.log" 2>&1
echo "tests: exit $? ($(tail -1 "$OUT/tests.log"))"
timeout 150 python3 -m pytest -q tests/test_cupy_backend.py -k "gpu and dropout" >> "$OUT/tests.log" 2>&1
echo "cupy gpu dropout tests: exit $? ($(tail -1 "$OUT/tests.log"))"

timeout 200 python3 -m mhattn.cli bench --latency --impl triton,cupy,sdpa-default --json "$OUT/latency.json" \
    > "$OUT/latency.txt" 2> "$OUT/latency.log"
echo "bench --latency: exit $?"
cat "$OUT/latency.txt"
