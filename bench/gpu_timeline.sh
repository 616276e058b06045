#!/usr/bin/env bash
# One device call, steps in priority order, each left out when less than its limit is left
# of DEADLINE seconds (default 480):
#   1. where a transformers token's time goes at the warm 3 GiB budget (1.55 GiB of cache),
#      BF16, plain and with next-layer prediction: bench.experts_profile --timeline (torch
#      profiler: the device's kernels, uploads, their overlap and idle time a token)
#   2. bench.transformers' warm and in_place runs (misses read in place from the registered
#      mapping by the whole-layer gather, no host read of the routing) against the resident
#   3. the same timelines for FP8, then every expert held beside the resident model
#   4. bench.transformers' resident, all, warm and predict runs (BF16)
# Writes $OUT/timeline.tgz (reports, traces, JSON) and $OUT/summary.txt.
# Usage (GPU machine, repo root, .whl here): bash bench/gpu_timeline.sh
set -u
DEADLINE=${DEADLINE:-480} R=/tmp/timeline
source bench/gpu_steps.sh
B=/tmp/q/bf16-qwen3-30b-a3b-8-spread F=/tmp/q/fp8-qwen3-30b-a3b-8-spread
[ -d $F ] || step make 150 python3 -m bench.quantized --make /tmp/q --format fp8 \
  --shape qwen3-30b-a3b --layers 8 --tokens 4 --repeat 1 --spread --runs fp8 --out $R/make.json
P="python3 -m bench.experts_profile --device cuda --tokens 32 --top 60 --fresh --timeline"
for prefetch in none predict; do
  step bf16-$prefetch 90 $P -m $B --budget 1.55GiB --mode resident --prefetch $prefetch --out $R/bf16-$prefetch.txt
done
step in-place 150 python3 -m bench.transformers -m $B --total 3GiB --tokens 32 \
  --runs resident,warm,in_place --out $R/in_place.json
for prefetch in none predict; do
  step fp8-$prefetch 90 $P -m $F --budget 1.55GiB --mode resident --prefetch $prefetch --out $R/fp8-$prefetch.txt
done
step bf16-all 120 $P -m $B --resident --out $R/bf16-all.txt
step transformers 200 python3 -m bench.transformers -m $B --total 3GiB --tokens 32 \
  --runs resident,all,warm,predict --out $R/transformers.json
{ cat $R/steps.txt; grep -h -A1 "^==" $R/*.txt
  python3 - $R/in_place.json $R/transformers.json <<'PY'
import json, sys
for path in sys.argv[1:]:
    try:
        report = json.load(open(path))
    except OSError:
        continue
    runs = report.get("runs", report)
    for name, run in runs.items():
        if isinstance(run, dict):
            print(name, {k: run.get(k) for k in ("tokens_per_s_runs", "x_resident", "hit_rate",
                                                  "same_tokens") if k in run})
PY
} 2>&1 | tee $OUT/summary.txt
cp $R/machine.txt $OUT/ && tar czf $OUT/timeline.tgz -C $R .
