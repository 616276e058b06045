#!/usr/bin/env bash
# One device call: where a transformers token's time goes on the GPU, BF16 and FP8 at the
# warm 3 GiB budget (1.55 GiB of cache), plain and with next-layer prediction, then every
# expert held beside the resident model: bench.experts_profile --timeline (torch profiler,
# the device's kernels, uploads, their overlap and idle time a token; bench/timeline.py);
# then bench.transformers' resident, all, warm and predict runs (BF16).
# Writes $OUT/timeline.tgz (reports, traces, the bench's JSON) and $OUT/summary.txt.
# Usage (GPU machine, repo root, .whl here): bash bench/gpu_timeline.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=/tmp/timeline; mkdir -p $R
{ nvidia-smi -L; python3 -c 'import torch, transformers, cupy; print("torch", torch.__version__, "transformers", transformers.__version__, "cupy", cupy.__version__)'; } > $R/machine.txt
B=/tmp/q/bf16-qwen3-30b-a3b-8-spread F=/tmp/q/fp8-qwen3-30b-a3b-8-spread
[ -d $F ] || python3 -m bench.quantized --make /tmp/q --format fp8 --shape qwen3-30b-a3b --layers 8 \
  --tokens 4 --repeat 1 --spread --runs fp8 --out $R/make.json > $R/make.log 2>&1
P="python3 -m bench.experts_profile --device cuda --tokens 32 --top 60 --fresh --timeline"
for m in bf16:$B fp8:$F; do
  for prefetch in none predict; do
    timeout 120 $P -m ${m#*:} --budget 1.55GiB --mode resident --prefetch $prefetch \
      --out $R/${m%%:*}-$prefetch.txt > $R/${m%%:*}-$prefetch.log 2>&1
  done
done
timeout 150 $P -m $B --resident --out $R/bf16-all.txt > $R/bf16-all.log 2>&1
timeout 200 python3 -m bench.transformers -m $B --total 3GiB --tokens 32 \
  --runs resident,all,warm,predict --out $R/transformers.json > $R/transformers.log 2>&1
grep -h -A1 "^==" $R/*.txt | tee $OUT/summary.txt
python3 - $R/transformers.json <<'PY' 2>&1 | tee -a $OUT/summary.txt
import json, sys
for name, run in json.load(open(sys.argv[1]))["runs"].items():
    print(name, run.get("tokens_per_s_runs"), run.get("x_resident"), run.get("hit_rate"),
          run.get("same_tokens"))
PY
cp $R/machine.txt $OUT/ && tar czf $OUT/timeline.tgz -C $R .
