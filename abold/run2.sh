#!/bin/bash
# Session 63, call 2: mhattn tune --head-dim 96,192 on top of the shipped table; bench auto at d = 96 and 192.
source benchmarks/device_env.sh
R=$PWD
export MHATTN_CACHE_DIR=$OUT/cache
echo "== tune $(date -u +%H:%M:%S)"
cd /tmp
timeout 280 python3 -m mhattn.cli tune --quick --head-dim 96,192 --no-progress --output $OUT/h200_d96_d192.json 2>&1 | tail -40
echo "== bench $(date -u +%H:%M:%S)"
MHATTN_TABLE=$OUT/h200_d96_d192.json timeout 250 python3 -m mhattn.cli bench --impl auto,triton,cupy,sdpa-cudnn \
  --dtype bf16 --head-dim 96,192 --seqlen 1k,4k,16k --no-progress --time-limit 220 --summary \
  --markdown $OUT/auto_d96_d192.md --json $OUT/auto_d96_d192.json 2>&1 | tail -40
echo "== end $(date -u +%H:%M:%S)"
