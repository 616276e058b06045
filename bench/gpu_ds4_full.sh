#!/usr/bin/env bash
# DeepSeek V4 Flash as ds4 lays it out, at full shape: all 43 layers x 256 experts
# (IQ2_XXS gate/up, Q2_K down, real attention and vocabulary: 80.8 GiB), generating real
# tokens through the transformers path, its experts streamed quantized and dequantized on the
# device. The GPU machine's disk (64 GB) cannot hold the file, so it is written split as
# gguf-split writes one (make_model --shard-size 4GiB): the shards that fit the disk on it,
# the rest on a tmpfs (RAM), each named in one directory. "Cold" evicts the disk shards'
# pages (tools.warmup --evict) and reads by O_DIRECT (--mode direct: resident mode's
# background warm-up would read the file back while the model loads); the tmpfs shards stay
# in RAM, so a cold run is cold for the disk's share only (the script prints both shares).
# Steps (STEPS, comma-separated; default make,warm):
#   make  mount the tmpfs, link the shards past the disk's room to it, write the model
#   warm  pipeline.run --engine transformers per budget (BUDGETS, default "11GiB 40GiB";
#         30GiB for the larger on an H100),
#         page cache warm, with its run log, then tools.analyze of the log (the time split)
#   cold  per budget (COLD_BUDGETS, default "11GiB"): the disk shards' pages evicted, then
#         the same run in direct mode
# Usage (GPU machine, repo root; the machine kept warm between calls keeps the files):
#   MOESTREAM_COMMIT=<sha> STEPS=make,warm bash bench/gpu_ds4_full.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
D=/tmp/ds4full T=/mnt/ds4full
steps=${STEPS:-make,warm}
FINAL=$OUT; OUT=/tmp/ds4-results; mkdir -p $OUT  # at most 8 files come back: one archive
pack() { tar czf $FINAL/ds4-full-${steps//,/-}.tgz -C $OUT .; }
trap pack EXIT
echo "commit ${MOESTREAM_COMMIT:-unknown}"; nvidia-smi -L; free -g | head -2; df -h /tmp | tail -1
if [[ $steps == *make* ]]; then
  mkdir -p $D $T
  # the shards make_model will write, and which of them the disk takes (6 GiB kept free)
  python3 - $D $T <<'PY' > $OUT/ds4-full-shards.txt || exit 1
import os, shutil, sys
from moestream.pipeline.foundation.gguf_split import shard_name
from moestream.pipeline.makers.modelgen import _shards, spec_for
from moestream.pipeline.makers.modeldata import plan_tensors
d, t = sys.argv[1:]
spec = spec_for("ds4-flash-q2", None, None, 0, ds4_shape="flash")
sizes = [sum(p.nbytes for x in s for p in x.pieces) for s in _shards(plan_tensors(spec), 4 << 30)]
room, held, on_tmpfs = shutil.disk_usage(d).free - (6 << 30), 0, 0
for i, size in enumerate(sizes):
    name = shard_name("ds4", i + 1, len(sizes))
    held += size
    if held > room:
        os.symlink(os.path.join(t, name), os.path.join(d, name))
        on_tmpfs += size
print(f"shards {len(sizes)} bytes {sum(sizes)} on_tmpfs {on_tmpfs} on_disk {sum(sizes) - on_tmpfs}")
print(f"tmpfs_gib {on_tmpfs // 2**30 + 2}")
PY
  cat $OUT/ds4-full-shards.txt
  mount -t tmpfs -o size=$(awk '/tmpfs_gib/ {print $2}' $OUT/ds4-full-shards.txt)G tmpfs $T \
    || { echo "no tmpfs: the full shape cannot be written here"; exit 1; }
  t0=$(date +%s)
  python3 -m tools.make_model $D/ds4.gguf --preset ds4-flash-q2 --ds4-shape flash --no-digests \
    --shard-size 4GiB 2>&1 | tail -1 | tee $OUT/ds4-full-make.txt
  echo "made in $(( $(date +%s) - t0 )) s"; free -g | head -2; df -h /tmp $T | tail -2
fi
M=$(ls $D/ds4-00001-of-*.gguf)
run() {  # name budget mode
  local t0=$(date +%s)
  timeout ${RUN_S:-200} python3 -m pipeline.run --engine transformers -m $M --prompt-ids 1,2,3,4 \
    --tokens ${TOKENS:-16} --cache-budget $2 --mode $3 --log $OUT/$1.jsonl > $OUT/$1.txt 2>&1
  echo "$1 rc=$? in $(( $(date +%s) - t0 )) s"
  grep -v "Warning\|warn(\|deprecated" $OUT/$1.txt | tail -7
  timeout 60 python3 -m tools.analyze $OUT/$1.jsonl > $OUT/$1-analyze.txt 2>&1
  head -24 $OUT/$1-analyze.txt
}
if [[ $steps == *warm* ]]; then
  big=40GiB  # an H100's 80 GB holds the float32 dense weights and 30 GiB, not 40
  [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -lt 100000 ] && big=30GiB
  for budget in ${BUDGETS:-11GiB $big}; do run ds4-full-warm-$budget $budget resident; done
fi
if [[ $steps == *cold* ]]; then
  for budget in ${COLD_BUDGETS:-11GiB}; do
    timeout 120 python3 -m tools.warmup $M --evict 2>&1 | tail -1
    run ds4-full-direct-cold-$budget $budget direct
  done
fi
