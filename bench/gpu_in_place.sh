#!/usr/bin/env bash
# One device call for misses read in place and quantized layers on the whole-layer path,
# steps in priority order, each left out when less than its limit is left of DEADLINE (580 s):
#   1. the GPU tests of both (in place, quantized slots, the dequantization kernels)
#   2. bench.quantized on a --spread FP8 model of Qwen3-30B-A3B's layer shape (8 layers) at
#      3 GiB: the dequantized resident reference, FP8 and its BF16 original on the lease path
#      and in place, FP8 holding every expert; tokens checked against the reference's
#   3. bench.transformers on the BF16 model: resident, warm (the lease path) and in_place
# Writes $OUT/in_place.tgz and $OUT/summary.txt.
# Usage (GPU machine, repo root, .whl here): bash bench/gpu_in_place.sh
set -u
DEADLINE=${DEADLINE:-580} R=/tmp/in_place
source bench/gpu_steps.sh
step gpu-test 120 python3 -m pytest -p no:cacheprovider -q -m gpu \
  tests/transformers/test_transformers_in_place.py tests/transformers/test_whole_quantized.py \
  tests/transformers/test_dequant_batch_cuda.py tests/transformers/test_dequant_cuda.py \
  tests/transformers/test_gguf_cuda.py
step quantized 330 python3 -m bench.quantized --make /tmp/q --format fp8 --shape qwen3-30b-a3b \
  --layers 8 --spread --total 3GiB --tokens 32 \
  --runs reference,fp8,fp8_in_place,bf16,bf16_in_place,fp8_all --out $R/quantized.json
step transformers 120 python3 -m bench.transformers --make /tmp/q/bf16-qwen3-30b-a3b-8-spread \
  --shape qwen3-30b-a3b --layers 8 --spread --total 3GiB --tokens 32 \
  --runs resident,warm,in_place --out $R/transformers.json
{ cat $R/steps.txt; tail -3 $R/gpu-test.log 2>/dev/null
  python3 - $R/quantized.json $R/transformers.json <<'PY'
import json, os, sys
for path in sys.argv[1:]:
    if not os.path.exists(path):
        continue
    report = json.load(open(path))
    print(path, report.get("ratios", ""))
    for name, run in report["runs"].items():
        print(" ", name, run.get("skipped") or (run.get("tokens_per_s_runs"),
              run.get("x_resident"), run.get("hit_rate"), run.get("misses"),
              run.get("file_bytes"), run.get("same_tokens")))
PY
} 2>&1 | tee $OUT/summary.txt
cp $R/machine.txt $OUT/ && tar czf $OUT/in_place.tgz -C $R .
