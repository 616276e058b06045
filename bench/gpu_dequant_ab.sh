#!/usr/bin/env bash
# One layer's top-k experts dequantized on the device against their upload (bench.dequant),
# this tree against another (OLD: a folder holding an older tree), in turns, ROUNDS times,
# each format at its model's shape: FP8 at Qwen3-30B-A3B's (8 experts of 2048 x 768), MXFP4
# at gpt-oss-120b's (4 of 2880 x 2880), FP4 at DeepSeek-V4-Flash's (6 of 4096 x 2048).
# Then the GGUF kernels (bench.gguf_dequant, TYPES at both default shapes: kernel_expert_ms
# against upload_ms). Writes $OUT/dequant-ab.tgz (<tree>-<format>-<round>.json) and prints one
# line a run.
# Usage (GPU machine, repo root, .whl here): OLD=/tmp/old bash bench/gpu_dequant_ab.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
R=$OUT/dequant-ab NEW=$PWD
mkdir -p $R
for round in $(seq ${ROUNDS:-2}); do
  for tree in new old; do
    [ $tree = new ] && dir=$NEW || dir=$OLD
    for f in fp8:8:2048:768 mxfp4:4:2880:2880 fp4:6:4096:2048; do
      IFS=: read -r fmt experts hidden ffn <<< "$f"
      (cd $dir && PYTHONPATH=/tmp/site:$dir timeout 120 python3 -m bench.dequant --format $fmt \
        --experts $experts --hidden $hidden --ffn $ffn --out $R/$tree-$fmt-$round.json \
        > /dev/null 2> $R/$tree-$fmt-$round.err)
      python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[2], r['format'],
        r['dequant_device_ms'], r['upload_ms'], r['dequant_device_over_upload'])" \
        $R/$tree-$fmt-$round.json "$tree r$round" 2>/dev/null || echo "$tree $fmt r$round failed"
    done
    (cd $dir && PYTHONPATH=/tmp/site:$dir timeout 150 python3 -m bench.gguf_dequant --device cuda \
      --types ${TYPES:-IQ2_XXS,Q2_K,Q4_K,Q8_0} --repeats 10 --out $R/$tree-gguf-$round.json \
      > /dev/null 2> $R/$tree-gguf-$round.err)
    python3 -c "import json,sys; [print(sys.argv[2], r['type'], r['shape'], r.get('kernel_expert_ms'),
      r['upload_ms'], round(r.get('kernel_expert_ms', 0) / r['upload_ms'], 3), r.get('kernel_same_values'))
      for r in json.load(open(sys.argv[1]))['rows']]" $R/$tree-gguf-$round.json "$tree r$round" \
      2>/dev/null || echo "$tree gguf r$round failed"
  done
done
# the device tool returns a few files of a folder: the runs' JSON as one archive beside it
tar czf $OUT/dequant-ab.tgz -C $R . && rm -rf $R
