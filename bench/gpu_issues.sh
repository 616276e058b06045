#!/usr/bin/env bash
# One H200 lease for the house move's GPU checks (run from the repo root on the GPU machine,
# with .whl carried): GPU tests after the house move, the engine example on CuPy, the time
# breakdown of a direct, a resident and an all-cached run, and the pipeline bench on the
# Qwen3-30B-A3B shape (no recorded digests) with and without verification.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XDG_CACHE_HOME=$PWD/.cache
# at most 8 files come back from a lease: results go to one archive, packed after each step
FINAL=$OUT; OUT=$PWD/gpu-out; mkdir -p $OUT
pack() { tar -czf $FINAL/results.tgz -C $OUT .; }
nvidia-smi -L
timeout 170 python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests 2>&1 | tail -15 > $OUT/gpu-tests.log
tail -3 $OUT/gpu-tests.log; pack
timeout 60 python3 examples/engine.py -n 8 > $OUT/engine.log 2>&1; echo "engine rc=$?"; tail -3 $OUT/engine.log
timeout 90 python3 -m bench.faultmatrix --backend cupy --json $OUT/faultmatrix-cupy-h200.json \
  > $OUT/faultmatrix.log 2>&1; echo "faultmatrix rc=$?"; grep -c "| ok |" $OUT/faultmatrix.log; pack
# time breakdown: ds4-flash-q2, 8 layers x 256 experts (13.6 GiB)
M=$PWD/ds4-8.gguf
python3 -m tools.make_model $M --preset ds4-flash-q2 --layers 8 --experts 256 | tail -1
python3 -m tools.warmup $M --evict > /dev/null
R="python3 -m pipeline.run -m $M --backend cupy --compute fixed --json --limits read=1.85GB/s,copy=55GB/s"
timeout 60 $R --mode direct -n 32 --cache-budget 300 --log $OUT/t-direct.jsonl > /dev/null
python3 -m tools.warmup $M > /dev/null
timeout 60 $R --mode resident -n 96 --cache-budget 300 --log $OUT/t-resident.jsonl > /dev/null
timeout 60 $R --mode resident -n 300 --log $OUT/t-cached.jsonl > /dev/null
for r in direct resident cached; do
  python3 -m tools.analyze $OUT/t-$r.jsonl --json > $OUT/t-$r.json 2>&1
  python3 -m tools.analyze $OUT/t-$r.jsonl | grep -iE "bound|wall ms|verdict" | head -4
done
python3 -m tools.analyze $OUT/t-resident.jsonl --plot $OUT/plots-resident > /dev/null 2>&1
python3 -m tools.analyze $OUT/t-direct.jsonl --plot $OUT/plots-direct > /dev/null 2>&1
pack
rm -f $M
# the Qwen3-30B-A3B shape as real files come (no digests), verification on / off
Q=$PWD/qwen.gguf
python3 -m tools.make_model $Q --preset qwen3-30b-a3b --no-digests | tail -1
python3 -m tools.warmup $Q --digests > /dev/null 2>&1
timeout 150 python3 -m bench.pipeline --model $Q --backend cupy --naive-tokens 8 --lookahead 8 \
  --out $OUT/pipeline-qwen-h200.json > $OUT/pipeline-qwen-h200.log 2>&1; tail -12 $OUT/pipeline-qwen-h200.log; pack
timeout 110 python3 -m bench.pipeline --model $Q --backend cupy --naive-tokens 8 --lookahead 8 \
  --skip cold --no-verify --out $OUT/pipeline-qwen-noverify-h200.json \
  > $OUT/pipeline-qwen-noverify-h200.log 2>&1; tail -12 $OUT/pipeline-qwen-noverify-h200.log; pack
