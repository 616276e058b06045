#!/usr/bin/env bash
# One device call (under 10 minutes on an H100): the GPU tests of the transformers path and
# the API, then the transformers path's figures on a model whose routing depends on the
# token (--spread), BF16 and FP8, held whole, warm, predicted, and profiled on the miss
# path, then FP8 against BF16 in bench.quantized with the gather kernel and with the copy
# engines (--no-gather), ~110 s (QUANTIZED=0 leaves it out). Writes under
# $OUT: a few summary files and results.tgz (the device tool returns at most 8 files).
# The session of 2026-12-06 (#4) ran it last (QUANTIZED=0, before --no-gather existed).
# Usage (GPU machine, repo root): MOESTREAM_COMMIT=<sha> bash bench/gpu_owed.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=/tmp/results; mkdir -p $R
nvidia-smi -L > $R/machine.txt
python3 -c 'import torch, transformers, cupy; print("torch", torch.__version__, "transformers", transformers.__version__, "cupy", cupy.__version__)' >> $R/machine.txt
B=/tmp/q/bf16-qwen3-30b-a3b-8-spread F=/tmp/q/fp8-qwen3-30b-a3b-8-spread  # 8 layers of Qwen3-30B-A3B's shape
step() {  # name, seconds, command...
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  timeout $limit "$@" > $R/$name.log 2>&1
  echo "$name rc=$? in $(( $(date +%s) - t0 )) s" | tee -a $R/steps.txt
}
step make 200 python3 -m bench.quantized --make /tmp/q --format fp8 --shape qwen3-30b-a3b --layers 8 \
  --tokens 4 --repeat 1 --spread --runs fp8 --out $R/make.json &
step gpu-tests 200 python3 -m pytest -p no:cacheprovider -m gpu -rs tests/transformers tests/api
wait
tail -1 $R/gpu-tests.log | tee -a $R/steps.txt
step transformers 150 python3 -m bench.transformers -m $B --total 3GiB --tokens 32 \
  --runs resident,all,warm,predict,alternate --out $R/transformers.json
for m in bf16:$B fp8:$F; do
  step profile-${m%%:*} 80 python3 -m bench.experts_profile -m ${m#*:} --device cuda --tokens 32 --top 120 \
    --budget 1.55GiB --mode resident --fresh --out $R/profile-${m%%:*}.txt
done
if [ "${QUANTIZED:-1}" = 1 ]; then  # FP8 against BF16, misses by the gather kernel and without
  step quantized-fp8 150 python3 -m bench.quantized --make /tmp/q --format fp8 --shape qwen3-30b-a3b \
    --layers 8 --total 3GiB --tokens 32 --spread --runs reference,fp8,bf16 --out $R/quantized-fp8.json
  step quantized-fp8-copies 150 python3 -m bench.quantized --make /tmp/q --format fp8 \
    --shape qwen3-30b-a3b --layers 8 --total 3GiB --tokens 32 --spread --runs fp8,bf16 --no-gather \
    --out $R/quantized-fp8-copies.json
fi
for f in $R/transformers.json $R/quantized-fp8.json $R/quantized-fp8-copies.json; do
  python3 - "$f" <<'PY' 2>/dev/null | tee -a $R/steps.txt
import json, sys
d = json.load(open(sys.argv[1]))
print(sys.argv[1].rsplit("/", 1)[-1], d.get("ratios", ""))
for name, run in d.get("runs", {}).items():
    print(" ", name, {k: run.get(k) for k in ("tokens_per_s", "x_resident", "hit_rate", "same_tokens")})
PY
done
grep -h "==" $R/profile-*.txt | tee -a $R/steps.txt
cp $R/steps.txt $R/machine.txt $OUT/ && tar czf $OUT/results.tgz -C $R .
