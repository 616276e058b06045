#!/usr/bin/env bash
# One device lease, every GPU figure: GPU tests, the pipeline bench, the controller bench,
# the warm-up bench and the prefetch bench. Writes everything under $OUT. Usage (on the GPU
# machine, repo root; the tree arrives there without .git, so pass the commit being measured):
#   MOESTREAM_COMMIT=<sha> bash bench/gpu_session.sh [pipeline,controller,warmup,prefetch,tests]
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PATH=$PWD/.whl:$PATH
chmod +x .whl/vmtouch 2>/dev/null
steps=${1:-tests,pipeline,controller,warmup,prefetch}
M=$PWD/bench-model.gguf
nvidia-smi -L; free -g | head -2
if [[ $steps == *tests* ]]; then
  timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | tail -5 | tee $OUT/gpu-tests.log
fi
[ -f $M ] || python3 -m tools.make_model $M --preset ds4-flash-q2 --layers 20 --experts 256 | tail -1
if [[ $steps == *pipeline* ]]; then
  timeout 200 python3 -m tools.bench --model $M --backend cupy --naive-tokens 8 --lookahead 8 \
    --out $OUT/pipeline-h200.json > $OUT/pipeline-h200.log 2>&1; tail -14 $OUT/pipeline-h200.log
fi
if [[ $steps == *controller* ]]; then
  timeout 240 python3 -m tools.bench_controller --model $M --backend cupy \
    --out $OUT/controller-h200.json > $OUT/controller-h200.log 2>&1
  grep -v "warm\.\|\[debug" $OUT/controller-h200.log | tail -22
fi
if [[ $steps == *warmup* ]]; then
  python3 -m tools.warmup $M > /dev/null 2>&1
  python3 -c "import subprocess, sys, time; t = time.perf_counter(); subprocess.run([sys.executable, '-m', 'tools.warmup', '$M', '--report', '--json'], stdout=open('$OUT/report.json', 'w'), check=True); print(f'report on resident model: {time.perf_counter() - t:.2f} s')" | tee $OUT/report-time.log
  timeout 150 python3 -m tools.bench_warmup --size-gib 8 --random --runs 2 --dir $PWD \
    --out $OUT/warmup-h200.json > $OUT/warmup-h200.log 2>&1; tail -8 $OUT/warmup-h200.log
fi
if [[ $steps == *prefetch* ]]; then
  # 3 direct runs of 24 tokens (~2.6 tok/s at disk speed) and 4 resident runs of 96 tokens
  timeout 200 python3 -m tools.bench_prefetch --model $M --backend cupy \
    --out $OUT/prefetch-h200.json > $OUT/prefetch-h200.log 2>&1; tail -20 $OUT/prefetch-h200.log
fi
