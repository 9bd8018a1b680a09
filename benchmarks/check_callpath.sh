#!/usr/bin/env bash
# GPU check of the call path (issue 11), a few minutes on an H100, from the repo root:
#   source benchmarks/device_env.sh && bash benchmarks/check_callpath.sh
# 1. the call-path tests (CUDA generator seeds, CUDA-graph replays drawing fresh dropout masks, every backend
#    drawing the same mask), decoding steps with a KV cache replayed from a CUDA graph, automatic selection during
#    CUDA graph capture (graph-replay times of a timing table), the GPU integration tests
#    (torch.compile, CUDA graphs, every backend), the sdpa backend's GPU tests (its native autograd path included),
#    the Triton launches through kept compiled handles, and the GPU dropout tests of both kernel families;
# 2. mhattn bench --latency beside sdpa-default (per-call GPU and host-loop time, forward and
#    forward+backward, at the four small shapes; auto = automatic selection);
# 3. a short decoding table (host-bound short caches and a long one; the short ones also replayed from a CUDA graph,
#    with auto and the paged cache beside the dense call).
# The tables are printed last. Logs under $OUT (default /tmp/mhattn_callpath): tests.log, latency.log,
# latency.json, latency.txt, decode.txt.

set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/mhattn_callpath}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

timeout 200 python3 -m pytest -q tests/test_call_path.py tests/test_functional.py tests/test_dispatch.py \
    tests/test_gpu_integration.py tests/test_sdpa_backend.py tests/test_triton_launcher.py \
    "tests/test_triton_backend.py::test_gpu_dropout_bits_and_keep_mask" \
    "tests/test_triton_backend.py::test_gpu_launches_through_kept_handles_stay_correct_as_addresses_strides_and_sizes_change" \
    "tests/test_triton_backend.py::test_gpu_repeated_backwards_give_what_a_backward_worked_out_in_full_gives" \
    "tests/test_triton_backend.py::test_gpu_output_only_forward_matches_forward" \
    "tests/test_inference.py::test_gpu_kvcache_steps_replayed_from_a_cuda_graph_follow_the_advancing_lengths" \
    "tests/test_tuning.py::test_gpu_a_captured_automatic_call_runs_the_fastest_replayed_backend" \
    tests/test_decode_bench.py \
    -k "not info_says" -rfE > "$OUT/tests.log" 2>&1
echo "tests: exit $? ($(tail -1 "$OUT/tests.log"))"
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -10
timeout 200 python3 -m pytest -q tests/test_cupy_backend.py -k "gpu and (dropout or output_only)" >> "$OUT/tests.log" 2>&1
echo "cupy gpu dropout and output-only tests: exit $? ($(tail -1 "$OUT/tests.log"))"

timeout 200 python3 -m mhattn.cli bench --latency --impl auto,triton,cupy,sdpa-default --json "$OUT/latency.json" \
    > "$OUT/latency.txt" 2> "$OUT/latency.log"
echo "bench --latency: exit $?"
timeout 100 python3 -m mhattn.cli bench --decode --seqlen 1k,8k,128k --batch 1,8 --nq 1,4 \
    --impl sdpa,sdpa-cudnn,triton,auto,kvcache,paged > "$OUT/decode.txt" 2> "$OUT/decode.log"
echo "bench --decode: exit $?"
cat "$OUT/decode.txt"
cat "$OUT/latency.txt"
