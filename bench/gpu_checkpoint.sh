#!/usr/bin/env bash
# One device lease for the checkpoint figures: python -m bench.pipeline on bf16 Hugging Face
# checkpoints of Qwen3-30B-A3B's per-layer shape (hidden 2048, 128 experts of FFN 768, top-8;
# 9 MiB an expert), made here with moestream.tools.make_model --format safetensors, no digests recorded
# (every run builds its manifest): per-expert tensors, then the fused layout. Writes under
# $OUT. Usage (on the GPU machine, repo root; the tree arrives without .git):
#   MOESTREAM_COMMIT=<sha> LAYERS=12 FUSED_LAYERS=8 bash bench/gpu_checkpoint.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi -L; free -g | head -2; df -h . | tail -1
run() {  # run NAME LAYERS [make_model options...]
  local name=$1 layers=$2; shift 2
  local m=$PWD/ckpt-$name
  t0=$(date +%s)
  timeout 120 python3 -m tools.make_model "$m" --format safetensors --preset qwen3-30b-a3b \
    --layers "$layers" --force "$@" 2>&1 | tail -1
  echo "made $m in $(( $(date +%s) - t0 )) s"
  timeout ${BENCH_S:-230} python3 -m bench.pipeline --model "$m" --backend cupy --naive-tokens 8 \
    --lookahead 8 --out $OUT/pipeline-$name.json > $OUT/pipeline-$name.log 2>&1
  echo "bench $name rc=$? (commit ${MOESTREAM_COMMIT:-unknown})"
  grep -A30 "^figures:" $OUT/pipeline-$name.log
  rm -rf "$m"
}
run per-expert ${LAYERS:-12}
run fused ${FUSED_LAYERS:-8} --fused-experts
