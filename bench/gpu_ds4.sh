#!/usr/bin/env bash
# One device call: DeepSeek V4 Flash as ds4 lays it out (tools.make_model's ds4-flash-q2
# preset at the real attention, vocabulary and expert shape, IQ2_XXS gate/up and Q2_K down,
# LAYERS of its 43 layers: the full file does not fit the GPU machine's 64 GB disk) generating
# real tokens through the transformers path, its experts streamed quantized and dequantized
# on the device. Per cache budget (BUDGETS), page cache warm: pipeline.run --engine transformers
# with its run log, then tools.analyze of the log (the time split). Writes under $OUT.
# Usage (GPU machine, repo root): MOESTREAM_COMMIT=<sha> LAYERS=12 bash bench/gpu_ds4.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
L=${LAYERS:-12}
M=/tmp/ds4-flash-q2-${L}l.gguf
t0=$(date +%s)
[ -f $M ] || python3 -m tools.make_model $M --preset ds4-flash-q2 --layers $L --ds4-shape flash \
  --no-digests 2>&1 | tail -1
echo "made $M in $(( $(date +%s) - t0 )) s, $(du -h $M | cut -f1) (commit ${MOESTREAM_COMMIT:-unknown})"
for budget in ${BUDGETS:-11GiB 4GiB}; do
  for experts in ${EXPERTS:-grouped}; do
    name=ds4-$L-$budget-$experts
    t0=$(date +%s)
    timeout ${RUN_S:-150} python3 -m pipeline.run --engine transformers -m $M --prompt-ids 1,2,3,4 \
      --tokens ${TOKENS:-16} --cache-budget $budget --experts $experts --mode resident \
      --log $OUT/$name.jsonl > $OUT/$name.txt 2>&1
    echo "$name rc=$? in $(( $(date +%s) - t0 )) s"
    grep -v "Warning\|warn(\|deprecated" $OUT/$name.txt | tail -7
    timeout 60 python3 -m tools.analyze $OUT/$name.jsonl > $OUT/$name-analyze.txt 2>&1
    head -30 $OUT/$name-analyze.txt
  done
done
