#!/usr/bin/env bash
# One H200 lease: moestream.pipeline.cli.run before and after it moved onto the
# public API, alternating in one lease on one model (ds4-flash-q2, 20 layers x 256 experts):
# bench.pipeline's warm-resident and all-cached phases, twice per tree. Run from a clean
# snapshot of the new tree with the old one beside it (its path in OLD), .whl carried:
#   OLD=../.snap-old [ROUNDS=2] bash bench/gpu_api_ab.sh
# The GPU tests of the new tree run first; a failure stops the lease.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 XDG_CACHE_HOME=$PWD/.cache
NEW=$PWD; OLD=$(cd "$OLD" && pwd)
FINAL=$OUT; OUT=$PWD/gpu-out; mkdir -p $OUT
pack() { tar -czf $FINAL/results.tgz -C $OUT .; }
nvidia-smi -L
PYTHONPATH=/tmp/site:$NEW timeout 200 python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests \
  2>&1 | tail -15 > $OUT/gpu-tests.log
tail -3 $OUT/gpu-tests.log; pack
grep -q failed $OUT/gpu-tests.log && { echo "GPU tests failed: no bench"; exit 1; }
M=$PWD/ds4-20.gguf
PYTHONPATH=/tmp/site:$NEW python3 -m tools.make_model $M --preset ds4-flash-q2 --layers 20 \
  --experts 256 | tail -1
for round in $(seq ${ROUNDS:-2}); do
  for tree in old new; do
    dir=$NEW; [[ $tree == old ]] && dir=$OLD
    (cd $dir && PYTHONPATH=/tmp/site:$dir timeout 150 python3 -m bench.pipeline --model $M \
      --backend cupy --lookahead 8 --skip cold,cache --tokens 64 \
      --out $OUT/ab-$tree-$round.json > $OUT/ab-$tree-$round.log 2>&1)
    echo "$tree round $round:"; grep -E "^  [0-9]_" $OUT/ab-$tree-$round.log; pack
  done
done
rm -f $M
