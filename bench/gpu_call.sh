#!/usr/bin/env bash
# One device call in priority order, each step's output written to $OUT as it ends (a call
# cut at its limit still returns what ran), a step left out when less than its limit is
# left of DEADLINE seconds (default 560):
#   1. the dequantization kernels: GPU tests and bench.dequant against a base tree
#      (bench/gpu_kernels.sh, two rounds) -> $OUT/kernels.tgz
#   2. FP8 against BF16 on the --spread models, 3 GiB: misses by the copy engines
#      (--no-gather), then by the gather kernel; no reference run (tokens were checked
#      before) -> $OUT/copies.tgz, gather.tgz
#   3. bench.transformers on the BF16 --spread model: resident, all, warm, predict,
#      alternate -> $OUT/transformers.tgz
# (each step's files tarred as it ends: the device tool returns at most 8 files)
# Usage (GPU machine, repo root, .whl here): BASE=/tmp/base bash bench/gpu_call.sh
set -u
START=$(date +%s); DEADLINE=${DEADLINE:-560}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R/kernels $R/gather $R/copies $R/transformers
{ nvidia-smi -L; python3 -c 'import torch, transformers, cupy; print("torch", torch.__version__, "transformers", transformers.__version__, "cupy", cupy.__version__)'; } > $OUT/machine.txt
step() {  # name, seconds, command...: run it if its limit fits before the deadline
  local name=$1 limit=$2; shift 2
  local left=$(( DEADLINE - ($(date +%s) - START) ))
  if [ $left -lt $limit ]; then echo "$name skipped: $left s left" >> $OUT/steps.txt; return; fi
  local t0=$(date +%s)
  timeout $limit "$@"
  echo "$name rc=$? in $(( $(date +%s) - t0 )) s" >> $OUT/steps.txt
  tar czf $OUT/$name.tgz -C $R $name
}
step kernels 130 env OUT=$R/kernels ROUNDS=2 bash bench/gpu_kernels.sh
Q="python3 -m bench.quantized --make /tmp/q --format fp8 --shape qwen3-30b-a3b --layers 8 --total 3GiB --tokens 32 --spread"
step copies 170 sh -c "$Q --runs fp8,bf16 --no-gather --out $R/copies/quantized.json > $R/copies/log 2>&1"
step gather 100 sh -c "$Q --runs fp8,bf16 --out $R/gather/quantized.json > $R/gather/log 2>&1"
step transformers 150 sh -c "python3 -m bench.transformers -m /tmp/q/bf16-qwen3-30b-a3b-8-spread --total 3GiB --tokens 32 --runs resident,all,warm,predict,alternate --out $R/transformers/transformers.json > $R/transformers/log 2>&1"
