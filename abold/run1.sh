#!/bin/bash
# Session 63, call 1: left padding with dropout (forward) and deterministic backwards on the Gluon kernels.
source benchmarks/device_env.sh
R=$PWD
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
echo "== tests $(date -u +%H:%M:%S)"
timeout 320 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_triton_backend.py \
  -k "key_padding_as_spans or gluon_backward_deterministic or left_padding or repeated_key_padded or graph_replays" \
  2>&1 | tail -15 | tee $OUT/tests.log
cd /tmp
echo "== prefill dropout fwd $(date -u +%H:%M:%S)"
timeout 75 python3 $R/benchmarks/check_inference.py --padded-prefill --dropout 0.1 2>&1 | tail -6
echo "== prefill dropout fwd+bwd $(date -u +%H:%M:%S)"
timeout 75 python3 $R/benchmarks/check_inference.py --padded-prefill --dropout 0.1 --backward 2>&1 | tail -6
echo "== prefill deterministic fwd+bwd $(date -u +%H:%M:%S)"
timeout 75 python3 $R/benchmarks/check_inference.py --padded-prefill --backward --deterministic 2>&1 | grep -v Warning | tail -6
echo "== end $(date -u +%H:%M:%S)"
