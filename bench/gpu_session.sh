#!/usr/bin/env bash
# One device lease, every GPU figure: GPU tests, the pipeline bench, the controller bench,
# the warm-up bench and the prefetch bench (Q2 trace runs, then live-router runs on a
# temporary F16 model when 20 GiB of disk are free). Writes everything under $OUT. Usage (on
# the GPU machine, repo root; the tree arrives there without .git, so pass the commit):
#   MOESTREAM_COMMIT=<sha> bash bench/gpu_session.sh [pipeline,controller,warmup,prefetch,tests]
# Step devices (not in the default list: it needs 2 GPUs) compares devices 0,1 with device 0
# alone: host-to-device copy bandwidth, and tokens/s in direct and resident modes.
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
  timeout 200 python3 -m bench.pipeline --model $M --backend cupy --naive-tokens 8 --lookahead 8 \
    --out $OUT/pipeline-h200.json > $OUT/pipeline-h200.log 2>&1; tail -14 $OUT/pipeline-h200.log
fi
if [[ $steps == *controller* ]]; then
  timeout 420 python3 -m bench.controller --model $M --backend cupy \
    --partial-ram 20GiB --keep-logs $PWD/controller-logs --out $OUT/controller-h200.json \
    > $OUT/controller-h200.log 2>&1
  # one archive: a folder of logs did not come back from the lease
  tar -czf $OUT/controller-logs.tgz controller-logs && rm -rf controller-logs
  grep -v "warm\.\|\[debug" $OUT/controller-h200.log | tail -22
fi
if [[ $steps == *warmup* ]]; then
  python3 -m tools.warmup $M > /dev/null 2>&1
  python3 -c "import subprocess, sys, time; t = time.perf_counter(); subprocess.run([sys.executable, '-m', 'tools.warmup', '$M', '--report', '--json'], stdout=open('$OUT/report.json', 'w'), check=True); print(f'report on resident model: {time.perf_counter() - t:.2f} s')" | tee $OUT/report-time.log
  timeout 240 python3 -m bench.warmup --size-gib 8 --random --runs 5 --dir $PWD \
    --out $OUT/warmup-h200.json > $OUT/warmup-h200.log 2>&1; tail -8 $OUT/warmup-h200.log
fi
if [[ $steps == *prefetch* ]]; then
  # Whole step <= 240 s. Q2, trace routing: 3 direct runs of 24 tokens (~3 tok/s at disk
  # speed) and 4 resident runs of 96 tokens, ~65 s.
  timeout 90 python3 -m bench.prefetch --model $M --backend cupy \
    --out $OUT/prefetch-h200.json > $OUT/prefetch-h200.log 2>&1; tail -20 $OUT/prefetch-h200.log
  # Live router with real compute needs F16 experts: ds4-flash-f16, 8 layers x 48 experts
  # (~18.4 GiB, ~18 s at ~1.1 GB/s); live none + predict, direct 12 tokens (48 MiB misses at
  # ~1.3 GB/s) and resident 64 tokens, ~75 s. SIGINT lets make_model remove its temp file.
  F=$PWD/bench-f16.gguf
  free_gib=$(df -BG --output=avail "$PWD" | tail -1 | tr -dc 0-9)
  if (( free_gib >= 20 )); then
    timeout -s INT -k 5 40 python3 -m tools.make_model $F --preset ds4-flash-f16 --layers 8 \
      --experts 48 --force > $OUT/make-f16.log 2>&1 \
      && timeout 110 python3 -m bench.prefetch --live-only --live-model $F \
        --backend cupy --out $OUT/prefetch-live-h200.json > $OUT/prefetch-live-h200.log 2>&1
    tail -1 $OUT/make-f16.log; tail -12 $OUT/prefetch-live-h200.log 2>/dev/null
    rm -f $F $PWD/.bench-f16.gguf.*.tmp
  else
    echo "prefetch live: skipped, ${free_gib} GiB free (needs 20)" | tee $OUT/prefetch-live-h200.log
  fi
fi
if [[ $steps == *devices* ]]; then
  # Copies ~5 s; decode: 2 direct runs of 24 tokens (~3 tok/s at disk speed), reading the
  # file into the page cache once (~34 GiB), 2 resident runs of 96 tokens; ~90 s.
  if [ "$(nvidia-smi -L | wc -l)" -lt 2 ]; then
    echo "devices: needs 2 GPUs, this machine has $(nvidia-smi -L | wc -l)" | tee $OUT/devices.log
  else
    timeout 300 python3 -m bench.devices --model $M --backend cupy --devices 0,1 \
      --out $OUT/devices-h200x2.json > $OUT/devices.log 2>&1; tail -20 $OUT/devices.log
  fi
fi
