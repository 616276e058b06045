#!/usr/bin/env bash
# The GPU runs the session of 2026-12-06 (#3) left owed, in two device calls (PART=1, PART=2;
# each under 10 minutes on an H100 with a ~1.1-2 GB/s disk). Writes under $OUT.
#   PART=1: the decode-step deferral's GPU tests, then the all-cached and warm figures on
#           a model whose routing depends on the token (--spread), then a cold page cache
#           in auto mode (the warm-up's quiet time) against direct.
#   PART=2: the miss-bound quantized figures: FP8 against BF16, Q4_K GGUF against BF16.
# Usage (GPU machine, repo root): MOESTREAM_COMMIT=<sha> PART=1 bash bench/gpu_owed.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi -L > $OUT/machine.txt
python3 -c 'import torch, transformers, cupy; print("torch", torch.__version__, "transformers", transformers.__version__, "cupy", cupy.__version__)' >> $OUT/machine.txt
M=/tmp/spread-8l
make_model() {  # the spread model, 8 layers of Qwen3-30B-A3B's shape (11.2 GB)
  [ -f $M/config.json ] || timeout 200 python3 -c "from pathlib import Path; from bench.transformers import make_checkpoint as m; m(Path('$M'), 'qwen3-30b-a3b', 8, 'cuda', spread=True)" > /dev/null 2>&1
}
step() {  # name, seconds, command...
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  timeout $limit "$@" > $OUT/$name.log 2>&1
  echo "$name rc=$? in $(( $(date +%s) - t0 )) s"
}
if [ "${PART:-1}" = 1 ]; then
  step gpu-tests 200 python3 -m pytest -p no:cacheprovider -m gpu -rs \
    tests/transformers/test_transformers_nosync.py tests/transformers/test_transformers.py -k "Gpu or nosync"
  tail -3 $OUT/gpu-tests.log
  make_model
  step profile 120 python3 -m bench.experts_profile -m $M --device cuda --tokens 32 --top 30 \
    --resident --out $OUT/profile.txt
  grep "==" $OUT/profile.txt
  step transformers 200 python3 -m bench.transformers -m $M --total 3GiB --tokens 32 \
    --runs resident,all,warm,alternate --out $OUT/transformers.json
  step cold 150 sh -c "python3 -m bench.transformers -m $M --total 3GiB --tokens 32 --runs cold --repeat 2 --out $OUT/cold-auto.json && python3 -m bench.transformers -m $M --total 3GiB --tokens 32 --runs cold --repeat 2 --mode direct --out $OUT/cold-direct.json"
  dd if=$M/model.safetensors of=/dev/null iflag=direct bs=16M count=128 2> $OUT/disk-rate.txt
else
  step quantized-fp8 330 python3 -m bench.quantized --make /tmp/q --format fp8 --shape qwen3-30b-a3b \
    --layers 8 --total 3GiB --tokens 32 --spread --runs reference,fp8,bf16 --out $OUT/quantized-fp8.json
  rm -rf /tmp/q
  step gguf-model 250 python3 -m bench.gguf_model --make /tmp/g --shape qwen3-30b-a3b --layers 8 \
    --total 3GiB --spread --device cuda --out $OUT/gguf-model.json
fi
for f in $OUT/*.json; do
  python3 - "$f" <<'EOF' 2>/dev/null
import json, sys
d = json.load(open(sys.argv[1]))
print(sys.argv[1].rsplit("/", 1)[-1], d.get("ratios", d.get("gguf_over_bf16", "")))
for name, run in d.get("runs", {}).items():
    print(" ", name, {k: run.get(k) for k in ("tokens_per_s", "x_resident", "hit_rate", "same_tokens")})
EOF
done
