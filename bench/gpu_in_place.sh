#!/usr/bin/env bash
# One device call for misses read in place and quantized layers on the whole-layer path,
# steps in priority order, each left out when less than its limit is left of DEADLINE (590 s):
#   1. the GPU tests of both (in place, quantized slots, the dequantization kernels)
#   2. bench.quantized on a --spread FP8 model of Qwen3-30B-A3B's layer shape (8 layers) at
#      3 GiB, three rounds of the runs in turns (each ratio taken within a round): the
#      dequantized resident reference, FP8 and its BF16 original on the lease path, in place
#      and holding every expert; tokens checked against the reference's
#   3. bench.gguf_model in place: a Q4_K GGUF of the same shape against its BF16 checkpoint
#      at 3 GiB, alternated
#   4. bench.transformers on the BF16 model, three rounds in turns: resident, held (a budget
#      holding every expert as a user loads it: the fill), all, warm and in_place
# Writes $OUT/in_place.tgz and $OUT/summary.txt.
# Usage (GPU machine, repo root, .whl here): bash bench/gpu_in_place.sh
#   TESTS="tests" TEST_LIMIT=400: every GPU test first; TESTS="": none
set -u
DEADLINE=${DEADLINE:-590} R=/tmp/in_place
source bench/gpu_steps.sh
TESTS=${TESTS-tests/transformers/test_transformers_in_place.py tests/transformers/test_whole_quantized.py
  tests/transformers/test_dequant_batch_cuda.py tests/transformers/test_dequant_cuda.py
  tests/transformers/test_gguf_cuda.py}
[ -n "$TESTS" ] && step gpu-test ${TEST_LIMIT:-120} python3 -m pytest -p no:cacheprovider -q -m gpu $TESTS
step quantized 300 python3 -m bench.quantized --make /tmp/q --format fp8 --shape qwen3-30b-a3b \
  --layers 8 --spread --total 3GiB --tokens 32 --repeat 2 --rounds 3 \
  --runs reference,fp8,bf16,fp8_in_place,bf16_in_place,fp8_all,bf16_all --out $R/quantized.json
step gguf 150 python3 -m bench.gguf_model --make /tmp/q/bf16-qwen3-30b-a3b-8-spread \
  --shape qwen3-30b-a3b --layers 8 --total 3GiB --tokens 32 --warmup 32 --in-place \
  --out $R/gguf.json
step transformers 150 python3 -m bench.transformers --make /tmp/q/bf16-qwen3-30b-a3b-8-spread \
  --shape qwen3-30b-a3b --layers 8 --total 3GiB --tokens 32 --repeat 1 --rounds 3 \
  --runs resident,held,all,warm,in_place --out $R/transformers.json
{ cat $R/steps.txt; tail -3 $R/gpu-test.log 2>/dev/null
  python3 - $R/quantized.json $R/gguf.json $R/transformers.json <<'PY'
import json, os, sys
for path in sys.argv[1:]:
    if not os.path.exists(path):
        continue
    report = json.load(open(path))
    print(path, report.get("ratios", ""), report.get("ratios_rounds", ""))
    for name, run in report["runs"].items():
        each = run.get("rounds", [run])
        print(" ", name, run.get("tokens_per_s"), run.get("x_resident_rounds"),
              [r.get("skipped") or (r.get("tokens_per_s_runs"), r.get("hit_rate"),
                                    r.get("same_tokens")) for r in each])
PY
} 2>&1 | tee $OUT/summary.txt
cp $R/machine.txt $OUT/ && tar czf $OUT/in_place.tgz -C $R .
