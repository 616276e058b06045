#!/usr/bin/env bash
# One H200 lease for the pipeline's and the time split's figures (repo root on the GPU machine, .whl carried):
# the pipeline bench's warm-resident and all-cached phases, then verification on and off
# alternating in the same process (--ab-verify), on the
# Qwen3-30B-A3B shape (no recorded digests) and on ds4-flash-q2 (8 layers x 256 experts);
# the host-path bench on both; and the time breakdown of a resident run that the copy limit
# should bound (Mixtral-8x7B shape, 4 layers: 99 MB experts). Usage:
#   bash bench/gpu_figures.sh [tests,qwen,ds4,mixtral,profile,cold]
# (tests: the GPU tests first, and the fault matrix on CuPy; a failed GPU test stops the lease;
# profile: bench.profile's two phases on the Qwen shape, with qwen; cold: the bench's cold
# phase too, direct misses from storage against the best raw O_DIRECT read)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XDG_CACHE_HOME=$PWD/.cache
FINAL=$OUT; OUT=$PWD/gpu-out; mkdir -p $OUT
pack() { tar -czf $FINAL/results.tgz -C $OUT .; }
steps=${1:-tests,qwen,ds4,mixtral}
nvidia-smi -L
if [[ $steps == *tests* ]]; then
  timeout 200 python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests 2>&1 | tail -15 > $OUT/gpu-tests.log
  tail -3 $OUT/gpu-tests.log; pack
  grep -q failed $OUT/gpu-tests.log && { echo "GPU tests failed: no bench"; exit 1; }
  timeout 120 python3 -m bench.faultmatrix --backend cupy --json $OUT/faultmatrix-cupy.json \
    > $OUT/faultmatrix.log 2>&1; echo "faultmatrix rc=$? ok=$(grep -c '| ok |' $OUT/faultmatrix.log)"; pack
fi
SKIP=cold,cache; [[ $steps == *cold* ]] && SKIP=cache  # cold: direct mode from storage too
B="python3 -m bench.pipeline --backend cupy --lookahead 8 --skip $SKIP"
bench_shape() {  # name model: every phase verified, then verification on/off alternating
  timeout 300 $B --model $2 --ab-verify ${AB:-3} --tokens 128 --out $OUT/pipeline-$1.json \
    > $OUT/pipeline-$1.log 2>&1
  echo "$1:"; grep -E "^  [0-9]_|verification costs" $OUT/pipeline-$1.log; pack
  timeout 90 python3 -m bench.hostpath --model $2 --out $OUT/hostpath-$1.json > $OUT/hostpath-$1.log 2>&1
  tail -8 $OUT/hostpath-$1.log; pack
}
if [[ $steps == *qwen* ]]; then
  Q=$PWD/qwen.gguf
  python3 -m tools.make_model $Q --preset qwen3-30b-a3b --no-digests | tail -1
  python3 -m tools.warmup $Q --digests > /dev/null 2>&1
  bench_shape qwen $Q
  if [[ $steps == *profile* ]]; then  # where the host time goes, on this machine's CPU
    for ph in all-cached resident-miss; do
      timeout 90 python3 -m bench.profile --model $Q --backend cupy --phase $ph --top 40 \
        > $OUT/profile-qwen-$ph.log 2>&1; grep "us/layer" $OUT/profile-qwen-$ph.log
    done; pack
  fi
  rm -f $Q
fi
if [[ $steps == *ds4* ]]; then
  D=$PWD/ds4.gguf
  python3 -m tools.make_model $D --preset ds4-flash-q2 --layers 8 --experts 256 | tail -1
  bench_shape ds4 $D
  # the resident run of the time breakdown again, after the host-side batching
  python3 -m tools.warmup $D > /dev/null 2>&1
  timeout 60 python3 -m pipeline.run -m $D --backend cupy --compute fixed --mode resident -n 96 \
    --cache-budget 300 --limits read=1.85GB/s,copy=55GB/s --log $OUT/t-ds4-resident.jsonl > /dev/null
  python3 -m tools.analyze $OUT/t-ds4-resident.jsonl --json > $OUT/t-ds4-resident.json 2>&1
  python3 -m tools.analyze $OUT/t-ds4-resident.jsonl | grep -iE "bound|wall ms|verdict" | head -4
  rm -f $D; pack
fi
if [[ $steps == *mixtral* ]]; then
  X=$PWD/mixtral.gguf
  python3 -m tools.make_model $X --preset mixtral-8x7b --layers 4 | tail -1
  python3 -m tools.warmup $X > /dev/null 2>&1
  timeout 90 python3 -m pipeline.run -m $X --backend cupy --mode resident --compute fixed \
    --cache-budget 8 --limits read=1.85GB/s,copy=55GB/s -n 64 --log $OUT/t-mixtral-resident.jsonl > /dev/null
  python3 -m tools.analyze $OUT/t-mixtral-resident.jsonl --json > $OUT/t-mixtral-resident.json 2>&1
  python3 -m tools.analyze $OUT/t-mixtral-resident.jsonl | grep -iE "bound|wall ms|verdict" | head -4
  rm -f $X; pack
fi
