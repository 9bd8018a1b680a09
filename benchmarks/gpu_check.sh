#!/usr/bin/env bash
# The one script to run on a GPU machine: the GPU tests, the conformance suite, then the benchmarks
# (PERFORMANCE.md's sweep, the memory table, the module benchmark) with JSON, Markdown and PNG plots.
# Logs and results go to $OUT; the last thing printed is the short results table.
#
#   bash benchmarks/gpu_check.sh                                  # everything, within TOTAL_S seconds
#   QUICK=1 bash benchmarks/gpu_check.sh                          # bench --quick, module at 1k only
#   SKIP_TESTS=1 SKIP_CONFORMANCE=1 bash benchmarks/gpu_check.sh  # the benchmarks only
#   BENCH_ARGS="--dtype bf16,fp16" bash benchmarks/gpu_check.sh   # extra arguments for mhattn bench
#   FULL_CONFORMANCE=1 SKIP_TESTS=1 SKIP_BENCH=1 SKIP_PYTEST_BENCH=1 bash benchmarks/gpu_check.sh
#                                                  # conformance --full --jobs auto alone, with its reports
#
# The bench gets the time the earlier stages leave (it stops starting tasks at its time limit and still
# reports, plots and saves what ran): for the complete sweep in one call, run the benchmarks alone.
#
# FEATURE_CHECKS=callpath,inference,tune,cupy,cupy-hopper,triton-hopper,gluon-host,clocks,short-backward,short-forward,
# features,deterministic,padded-head-dims,masked-decode,left-padding,hf-model,gqa-backward
# runs those checks first
# (CHECK_S seconds each, default 300; INFERENCE_ARGS, TUNE_ARGS, CUPY_HOPPER_ARGS, TRITON_HOPPER_ARGS, FEATURES_ARGS,
# DETERMINISTIC_ARGS, GQA_ARGS passed on).
# Environment: OUT (default /tmp/mhattn_gpu_check), QUICK, SKIP_TESTS, SKIP_CONFORMANCE, SKIP_BENCH,
# SKIP_PYTEST_BENCH, GPU_TESTS (the test files for `pytest -m gpu`, default tests/: the whole GPU suite takes more
# than one 10-minute device call on an H100), FULL_CONFORMANCE (1: conformance --full --jobs auto instead of --quick), TOTAL_S
# (budget of the whole script, default 560), TESTS_S (default 180), CONFORMANCE_S (the --quick run, default
# 150), FULL_CONFORMANCE_S (the --full run, default 480), TASK_TIMEOUT_S (one bench task, default 150),
# MODULE_SEQLEN (default 1k,4k; 1k with QUICK), BENCH_ARGS.
# Files in $OUT (the device tool returns at most 8): checks.log, bench.txt, bench.log, bench.json,
# bench.md, attention_bf16.png, memory_module.png; with FULL_CONFORMANCE=1 also conformance_full.md and
# conformance_full.json.

set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/mhattn_gpu_check}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# shellcheck source=benchmarks/device_env.sh
source benchmarks/device_env.sh > "$OUT/checks.log" 2>&1

TOTAL_S="${TOTAL_S:-560}"
TESTS_S="${TESTS_S:-180}"
CONFORMANCE_S="${CONFORMANCE_S:-150}"
FULL_CONFORMANCE_S="${FULL_CONFORMANCE_S:-480}"
FULL_CONFORMANCE="${FULL_CONFORMANCE:-0}"
QUICK="${QUICK:-0}"
CHECKS="$OUT/checks.log"

left() { echo $((TOTAL_S - SECONDS)); }
stage() { echo; echo "== $* (at ${SECONDS} s)"; echo "== $*" >> "$CHECKS"; }
# the smaller of the stage's budget and what is left of the whole script's, keeping $2 s back
budget() { local want=$1 keep=$2 have; have=$(( $(left) - keep )); [ "$have" -lt "$want" ] && want=$have; echo "$want"; }

stage "device"
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 || true; } | tee -a "$CHECKS"
python3 -m mhattn.cli info >> "$CHECKS" 2>&1 || echo "mhattn info failed (see checks.log)"
grep -E "^(mhattn|torch|triton|cupy|device) " "$CHECKS" | head -6

if [ -n "${FEATURE_CHECKS:-}" ]; then
  # The per-feature GPU checks, one after another (each prints its own short table; logs in $OUT/<name>/):
  # callpath (bench --latency), inference (decode / varlen tables), tune (sdpa tests, tune --quick, auto vs
  # best), cupy (the CuPy feature variants), cupy-hopper (the CuPy Hopper kernels against float64 and beside
  # cuDNN, benchmarks/check_cupy_hopper.py), triton-hopper (the Gluon kernels of the Triton backend, each forward
  # grid, benchmarks/check_hopper.py), gluon-host (the host cost per call of the Gluon launches beside their GPU time,
  # benchmarks/host_profile.py --gluon), clocks (per-call times after an idle GPU and the GPU timer under four warm-up
  # settings, benchmarks/check_clocks.py), short-backward (the Triton short backward beside its three kernels, SDPA and
  # CuPy at short shapes, benchmarks/check_short_backward.py), short-forward (the Triton backend's kernel choice at up to
  # 1k keys beside the previous rules, SDPA and CuPy, benchmarks/check_short_forward.py), features (the Triton backend
  # with softcap, a window, dropout, a key-padding mask or bias at training shapes beside the plain call, SDPA and
  # FlexAttention, benchmarks/check_features.py), deterministic (the Triton backend's deterministic backwards, Gluon and
  # FlashAttention-2, beside its default one and cuDNN's, benchmarks/check_deterministic.py), padded-head-dims (the
  # Gluon kernels at head dims 96 and 192, their products split to the head dim where hopper_launch says: their GPU
  # tests, then `mhattn bench` with auto beside cuDNN in bf16 and fp16), masked-decode (decoding steps with a mask on the
  # split-KV kernels: their GPU tests, a tiny Llama generating from a left-padded batch, then
  # `check_inference.py --padded-decode` beside the FlashAttention-2 path and SDPA), left-padding (the Gluon kernels
  # with left-padding key masks: their GPU tests, then `check_inference.py --padded-prefill` forward,
  # forward+backward and forward with dropout beside the FlashAttention-2 kernels and SDPA), hf-model (the transformers
  # GPU tests, then a Llama-shaped model on mhattn beside sdpa, benchmarks/check_hf_model.py), gqa-backward (the Gluon
  # backward's partial dK and dV sums under GQA: their GPU tests, then benchmarks/check_gqa_backward.py beside SDPA with
  # the group walked by one program). ring needs two GPUs: torchrun
  # --nproc-per-node 2 benchmarks/check_ring.py on a two-GPU machine.
  for check in ${FEATURE_CHECKS//,/ }; do
    stage "feature check: $check"
    mkdir -p "$OUT/$check"
    case "$check" in
      callpath) OUT="$OUT/$check" timeout -k 10 "${CHECK_S:-300}" bash benchmarks/check_callpath.sh ;;
      inference) OUT="$OUT/$check" timeout -k 10 "${CHECK_S:-300}" python3 benchmarks/check_inference.py \
                   ${INFERENCE_ARGS:-} ;;
      tune) OUT="$OUT/$check" timeout -k 10 "${CHECK_S:-300}" python3 benchmarks/check_tune.py ${TUNE_ARGS:-} ;;
      cupy) OUT="$OUT/$check" timeout -k 10 "${CHECK_S:-300}" python3 benchmarks/check_cupy_features.py ;;
      cupy-hopper) timeout -k 10 "${CHECK_S:-300}" python3 benchmarks/check_cupy_hopper.py ${CUPY_HOPPER_ARGS:-} ;;
      triton-hopper) timeout -k 10 "${CHECK_S:-300}" python3 benchmarks/check_hopper.py ${TRITON_HOPPER_ARGS:-} ;;
      gluon-host) timeout -k 10 "${CHECK_S:-300}" python3 benchmarks/host_profile.py --gluon ;;
      clocks) timeout -k 10 "${CHECK_S:-300}" python3 benchmarks/check_clocks.py ;;
      short-backward) timeout -k 10 "${CHECK_S:-300}" python3 benchmarks/check_short_backward.py ;;
      short-forward) timeout -k 10 "${CHECK_S:-300}" python3 benchmarks/check_short_forward.py ;;
      features) timeout -k 10 "${CHECK_S:-300}" python3 benchmarks/check_features.py ${FEATURES_ARGS:-} ;;
      deterministic) timeout -k 10 "${CHECK_S:-300}" python3 benchmarks/check_deterministic.py \
                       ${DETERMINISTIC_ARGS:-} ;;
      padded-head-dims) timeout -k 10 "${CHECK_S:-300}" bash -c "python3 -m pytest -q -m gpu -p no:cacheprovider \
                          tests/test_triton_backend.py -k padded_head_dims | tail -3 && python3 -m mhattn.cli bench \
                          --impl auto,triton,sdpa-cudnn --head-dim 96,192 --seqlen 1k,4k,16k --dtype bf16,fp16 \
                          --no-progress --markdown '$OUT/$check/bench.md'" ;;
      masked-decode) timeout -k 10 "${CHECK_S:-300}" bash -c "python3 -m pytest -q -m gpu -p no:cacheprovider \
                       tests/test_inference.py tests/test_transformers_integration.py \
                       -k 'dense_decode or prepared_split or greedy' | tail -3 && \
                       python3 benchmarks/check_inference.py --padded-decode" ;;
      left-padding) timeout -k 10 "${CHECK_S:-300}" bash -c "python3 -m pytest -q -m gpu -p no:cacheprovider \
                      tests/test_triton_backend.py -k 'key_padding_as_spans or left_padding or graph_replays or \
                      repeated_key_padded' | tail -3 && python3 benchmarks/check_inference.py --padded-prefill && \
                      python3 benchmarks/check_inference.py --padded-prefill --backward && \
                      python3 benchmarks/check_inference.py --padded-prefill --dropout 0.1" ;;
      hf-model) timeout -k 10 "${CHECK_S:-300}" bash -c "python3 -m pytest -q -m gpu -p no:cacheprovider \
                  tests/test_transformers_integration.py | tail -3 && (cd /tmp && python3 $PWD/benchmarks/check_hf_model.py \
                  --backends auto,triton)" ;;
      gqa-backward) timeout -k 10 "${CHECK_S:-300}" bash -c "python3 -m pytest -q -m gpu -p no:cacheprovider \
                      tests/test_triton_backend.py -k 'partial_dk_dv or repeated_gluon' | tail -3 && (cd /tmp && \
                      python3 $PWD/benchmarks/check_gqa_backward.py ${GQA_ARGS:-})" ;;
      *) echo "unknown feature check $check (callpath, inference, tune, cupy, cupy-hopper, triton-hopper," \
           "gluon-host, clocks, short-backward, short-forward, features, deterministic, padded-head-dims," \
           "masked-decode, left-padding, hf-model, gqa-backward)" ;;
    esac 2>&1 | tail -n "${CHECK_TAIL:-40}"
  done
fi

if [ "${SKIP_TESTS:-0}" != 1 ]; then
  stage "GPU tests: pytest -m gpu tests/"
  limit=$(budget "$TESTS_S" 240)
  if [ "$limit" -gt 20 ]; then
    # One line per test, unbuffered: a run stopped by its time limit still shows what passed and where it was.
    timeout -k 10 "$limit" python3 -u -m pytest -v -m gpu ${GPU_TESTS:-tests/} -p no:cacheprovider >> "$CHECKS" 2>&1
    rc=$?
    [ "$rc" = 124 ] && echo "GPU tests stopped after ${limit} s (TESTS_S): $(grep -c ' PASSED' "$CHECKS") passed, at" \
      "$(grep -E '^tests/' "$CHECKS" | tail -1 | cut -d' ' -f1)"
    grep -E "^(FAILED|ERROR) " "$CHECKS" | head -25
    grep -E "(passed|failed|skipped|error).* in [0-9.]+s" "$CHECKS" | tail -1
  else
    echo "skipped: no time left"
  fi
fi

if [ "${SKIP_CONFORMANCE:-0}" != 1 ]; then
  if [ "$FULL_CONFORMANCE" = 1 ]; then
    stage "conformance: mhattn conformance --full --jobs auto"
    budget_name=FULL_CONFORMANCE_S
    limit=$(budget "$FULL_CONFORMANCE_S" "$([ "${SKIP_BENCH:-0}" = 1 ] && echo 20 || echo 200)")
    least=60
    # cases stop starting 30 s before the stage's end, so the table and the reports still get written
    args=(--full --jobs auto --time-limit $((limit - 30)) --report "$OUT/conformance_full.md"
          --report "$OUT/conformance_full.json")
  else
    stage "conformance: mhattn conformance --quick"
    budget_name=CONFORMANCE_S
    limit=$(budget "$CONFORMANCE_S" 200)
    least=20
    args=(--quick)
  fi
  if python3 -c "import mhattn.conformance.cli" 2>/dev/null; then
    if [ "$limit" -gt "$least" ]; then
      timeout -k 10 "$limit" python3 -m mhattn.cli conformance "${args[@]}" --no-progress > "$OUT/conformance.tmp" 2>&1
      rc=$?
      cat "$OUT/conformance.tmp" >> "$CHECKS"
      [ "$rc" = 124 ] && echo "conformance stopped after ${limit} s ($budget_name)"
      if [ "$FULL_CONFORMANCE" = 1 ] && grep -q "^feature " "$OUT/conformance.tmp"; then
        echo "mhattn conformance exit code $rc; reports in conformance_full.md and conformance_full.json"
        sed -n '/^feature /,$p' "$OUT/conformance.tmp"  # the table, its footnotes and the verdict
      else
        tail -n 30 "$OUT/conformance.tmp"
      fi
      rm -f "$OUT/conformance.tmp"
    else
      echo "skipped: no time left"
    fi
  else
    echo "skipped: mhattn.conformance.cli is not in this tree"
  fi
fi

if [ "${SKIP_BENCH:-0}" != 1 ]; then
  stage "benchmarks: mhattn bench"
  if [ "$QUICK" = 1 ]; then
    args=(--quick --memory --module --module-seqlen "${MODULE_SEQLEN:-1k}")
  else
    args=(--dtype bf16 --memory --module --module-seqlen "${MODULE_SEQLEN:-1k,4k}")
  fi
  # Tasks stop starting at the time limit; what ran is still reported, plotted and saved.
  limit=$(budget 100000 "$([ "${SKIP_PYTEST_BENCH:-0}" = 1 ] || [ "$QUICK" = 1 ] && echo 40 || echo 90)")
  [ "$limit" -lt 60 ] && limit=60
  # shellcheck disable=SC2086
  timeout -k 15 $((limit + 90)) python3 -m mhattn.cli bench "${args[@]}" ${BENCH_ARGS:-} --time-limit "$limit" \
    --task-timeout "${TASK_TIMEOUT_S:-150}" --json "$OUT/bench.json" --plot-dir "$OUT" --markdown "$OUT/bench.md" > "$OUT/bench.txt" 2> "$OUT/bench.log"
  rc=$?
  echo "mhattn bench exit code $rc after ${SECONDS} s; tables in bench.txt, progress and worker output in bench.log"
  grep -E "^(note:|plots skipped|plot .* failed|Traceback)" "$OUT/bench.log" | head -10
fi

if [ "${SKIP_PYTEST_BENCH:-0}" != 1 ] && [ "$QUICK" != 1 ]; then
  stage "pytest-benchmark: pytest benchmarks/ --benchmark-only"
  limit=$(budget 80 15)
  if ! python3 -c "import pytest_benchmark" 2>/dev/null; then
    echo "skipped: pytest-benchmark is not installed here"
  elif [ "$limit" -gt 20 ]; then
    timeout -k 5 "$limit" python3 -m pytest -q benchmarks/ --benchmark-only -p no:cacheprovider \
      --benchmark-columns=median,min,max,rounds --benchmark-sort=fullname >> "$CHECKS" 2>&1
    grep -E "(passed|failed|skipped|error).* in [0-9.]+s" "$CHECKS" | tail -1
  else
    echo "skipped: no time left"
  fi
fi

stage "results"
if [ -f "$OUT/bench.json" ]; then
  python3 -m mhattn.cli bench --from-json "$OUT/bench.json" --summary 2>&1
else
  echo "no bench.json: see bench.log"; tail -n 20 "$OUT/bench.log" 2>/dev/null
fi
echo "gpu_check done in ${SECONDS} s; files in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
