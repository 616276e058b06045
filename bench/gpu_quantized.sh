#!/usr/bin/env bash
# One device lease for quantized experts (about 4 minutes on an H100/H200 with a ~1.5 GB/s
# disk): the GPU tests of the dequantization kernels and the quantized models, then
# python -m bench.quantized for FP8 (Qwen3-30B-A3B's layer shape), MXFP4 (gpt-oss-120b's)
# and FP4 (DeepSeek-V4-Flash's), each model made here. Writes under $OUT.
# Usage (on the GPU machine, repo root):
#   MOESTREAM_COMMIT=<sha> bash bench/gpu_quantized.sh
# Sizes: FP8_LAYERS (4), OSS_LAYERS (2), V4_LAYERS (1), TOKENS (32), TOTAL (3GiB); TESTS=0
# skips the tests, FORMATS="fp8 mxfp4 fp4" picks the benches, BENCH_S (130) bounds each
# (150 + 3 x 130 s stays under a 10-minute command).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi -L; free -g | head -2; df -h . | tail -1
python3 -c 'import torch, transformers, cupy; print("torch", torch.__version__, "transformers", transformers.__version__, "cupy", cupy.__version__)'
if [ "${TESTS:-1}" = 1 ]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/transformers/test_dequant_batch_cuda.py tests/transformers/test_dequant_cuda.py \
    tests/transformers/test_transformers_fp8_gpu.py tests/transformers/test_transformers_mxfp4.py \
    tests/transformers/test_transformers_fp4.py 2>&1 | tail -15 | tee $OUT/gpu-quant-tests.log
fi
for fmt in ${FORMATS:-fp8 mxfp4 fp4}; do
  case $fmt in
    fp8) shape=qwen3-30b-a3b; layers=${FP8_LAYERS:-4};;
    mxfp4) shape=gpt-oss-120b; layers=${OSS_LAYERS:-2};;
    fp4) shape=deepseek-v4-flash; layers=${V4_LAYERS:-1};;
  esac
  t0=$(date +%s)
  timeout ${BENCH_S:-130} python3 -m bench.quantized --make $PWD/quantized-models --format $fmt \
    --shape $shape --layers $layers --total ${TOTAL:-3GiB} --tokens ${TOKENS:-32} \
    --out $OUT/quantized-$fmt.json > $OUT/quantized-$fmt.log 2>&1
  echo "bench.quantized $fmt rc=$? in $(( $(date +%s) - t0 )) s (commit ${MOESTREAM_COMMIT:-unknown})"
  python3 - "$OUT/quantized-$fmt.json" <<'EOF' || tail -5 $OUT/quantized-$fmt.log
import json, sys
d = json.load(open(sys.argv[1]))
print("ratios", d["ratios"])
for name, run in d["runs"].items():
    print(" ", name, {k: v for k, v in run.items() if k not in ("tokens", "time_ms")})
EOF
  rm -rf $PWD/quantized-models  # the next format's model needs the disk
done
