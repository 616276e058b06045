#!/usr/bin/env bash
# One device lease for moestream.transformers: the GPU tests of
# tests/transformers/test_transformers.py and test_transformers_nosync.py, bench.archs --device cuda,
# then python -m bench.transformers on a random Qwen3-MoE of Qwen3-30B-A3B's per-layer shape
# (LAYERS layers, 8: 11.2 GB, made here), then pipeline.run --engine transformers (RUN=0 skips it).
# Writes under $OUT. Usage (on the GPU machine, repo root):
#   MOESTREAM_COMMIT=<sha> bash bench/gpu_transformers.sh
# About 3 minutes on an H100: ARCHS=0 RUN=0 LAYERS=4 \
#   TESTS_K="GpuWholeLayers or (Gpu and (qwen3_moe or gpt_oss))" \
#   RUNS=resident,all,warm MOESTREAM_COMMIT=<sha> bash bench/gpu_transformers.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi -L; free -g | head -2; df -h . | tail -1
python3 -c 'import torch, transformers, cupy; print("torch", torch.__version__, "transformers", transformers.__version__, "cupy", cupy.__version__)'
timeout 420 python3 -m pytest -q -p no:cacheprovider tests/transformers/test_transformers.py \
  tests/transformers/test_transformers_nosync.py -k "${TESTS_K:-Gpu}" 2>&1 | tail -15 | tee $OUT/gpu-tests.log
# every model type bench.archs sweeps, through the CuPy backend (ARCHS=0 skips it)
if [ "${ARCHS:-1}" = 1 ]; then
  timeout 540 python3 -m bench.archs --device cuda --out $OUT/archs-h200.json 2>&1 | tail -60 \
    | tee $OUT/archs.log
fi
L=${LAYERS:-8}
M=$PWD/qwen3-30b-a3b-${L}l
if [ ! -f $M/config.json ]; then
  t0=$(date +%s)
  timeout 240 python3 -c "from bench.transformers import make_checkpoint as m; m(__import__('pathlib').Path('$M'), 'qwen3-30b-a3b', $L, 'cuda')" 2>&1 | tail -2
  echo "made $M in $(( $(date +%s) - t0 )) s: $(du -sh $M | cut -f1)"
fi
timeout ${BENCH_S:-420} python3 -m bench.transformers -m $M --total 3GiB --tokens ${TOKENS:-16} \
  --runs ${RUNS:-resident,eager,accelerate,warm,cold,all} --out $OUT/transformers-h200.json \
  > $OUT/bench.log 2>&1
echo "bench rc=$? (commit ${MOESTREAM_COMMIT:-unknown})"
grep -v "Warning\|warn(" $OUT/bench.log | tail -40
[ "${RUN:-1}" = 1 ] || exit 0
# the main job on the real model: moestream.pipeline.cli.run --engine transformers with its log, analyzed
timeout 120 python3 -m pipeline.run --engine transformers -m $M --prompt-ids 1,2,3,4 \
  --tokens 16 --cache-budget 1.5GiB --log $OUT/run-transformers.jsonl 2>&1 | tail -8
timeout 60 python3 -m tools.analyze $OUT/run-transformers.jsonl 2>&1 | tail -24
