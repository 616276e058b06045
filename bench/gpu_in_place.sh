#!/usr/bin/env bash
# One short device call for misses read in place (from_pretrained(in_place=True)), steps
# in priority order, each left out when less than its limit is left of DEADLINE (200 s):
#   1. bench.transformers on a --spread Qwen3-30B-A3B-shaped model (8 layers, BF16) at 3 GiB:
#      resident, warm (the lease path) and in_place, tokens checked against the resident's
#   2. the in-place GPU test (tests/transformers/test_transformers_in_place.py)
# Writes $OUT/in_place.tgz and $OUT/summary.txt.
# Usage (GPU machine, repo root, .whl here): bash bench/gpu_in_place.sh
set -u
DEADLINE=${DEADLINE:-200} R=/tmp/in_place
source bench/gpu_steps.sh
step transformers 170 python3 -m bench.transformers --make /tmp/q/bf16-qwen3-30b-a3b-8-spread \
  --shape qwen3-30b-a3b --layers 8 --spread --total 3GiB --tokens 32 \
  --runs resident,warm,in_place --out $R/transformers.json
step gpu-test 40 python3 -m pytest -p no:cacheprovider -q -m gpu tests/transformers/test_transformers_in_place.py
{ cat $R/steps.txt; tail -2 $R/gpu-test.log 2>/dev/null
  python3 - $R/transformers.json <<'PY'
import json, sys
for name, run in json.load(open(sys.argv[1]))["runs"].items():
    print(name, run.get("tokens_per_s_runs"), run.get("x_resident"), run.get("hit_rate"),
          run.get("misses"), run.get("file_bytes"), run.get("same_tokens"))
PY
} 2>&1 | tee $OUT/summary.txt
cp $R/machine.txt $OUT/ && tar czf $OUT/in_place.tgz -C $R .
