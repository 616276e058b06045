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
DEADLINE=${DEADLINE:-560} R=/tmp/r
source bench/gpu_steps.sh
mkdir -p $R/kernels $R/gather $R/copies $R/transformers
cp $R/machine.txt $OUT/
tarred() {  # name, seconds, command...: a step whose files, in $R/NAME, return tarred
  step "$@"
  cp $R/steps.txt $OUT/ && tar czf $OUT/$1.tgz -C $R $1 $1.log 2>/dev/null || true
}
tarred kernels 130 env OUT=$R/kernels ROUNDS=2 bash bench/gpu_kernels.sh
Q="python3 -m bench.quantized --make /tmp/q --format fp8 --shape qwen3-30b-a3b --layers 8 --total 3GiB --tokens 32 --spread"
tarred copies 170 sh -c "$Q --runs fp8,bf16 --no-gather --out $R/copies/quantized.json > $R/copies/log 2>&1"
tarred gather 100 sh -c "$Q --runs fp8,bf16 --out $R/gather/quantized.json > $R/gather/log 2>&1"
tarred transformers 150 sh -c "python3 -m bench.transformers -m /tmp/q/bf16-qwen3-30b-a3b-8-spread --total 3GiB --tokens 32 --runs resident,all,warm,predict,alternate --out $R/transformers/transformers.json > $R/transformers/log 2>&1"
