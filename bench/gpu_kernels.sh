#!/usr/bin/env bash
# One device call (~2 minutes): the dequantization kernels' GPU tests, then bench.dequant
# (one layer's 8 experts dequantized against their upload) for this tree and a base tree in
# turns, three rounds, each format at Qwen3-30B-A3B's expert shape and at its own model's
# (MXFP4 gpt-oss-120b, FP4 DeepSeek-V4-Flash). Writes $OUT/dequant.jsonl, tests.log and
# machine.txt. Usage (GPU machine, repo root; BASE: the base tree unpacked):
#   BASE=/tmp/base bash bench/gpu_kernels.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1
nvidia-smi -L > $OUT/machine.txt
PYTHONPATH=/tmp/site:$PWD timeout 240 python3 -m pytest -p no:cacheprovider -m gpu -rs \
  tests/transformers/test_dequant_batch_cuda.py tests/transformers/test_dequant_cuda.py \
  > $OUT/tests.log 2>&1
tail -1 $OUT/tests.log
for round in $(seq 0 $(( ${ROUNDS:-3} - 1 ))); do
  for tree in base:$BASE head:$PWD; do
    (cd ${tree#*:} && PYTHONPATH=/tmp/site:$PWD timeout 120 python3 - ${tree%%:*} $round <<'PY'
import json, sys
import torch
from bench.dequant import dequant_vs_upload
cuda = torch.device("cuda")
for method, hidden, ffn in (("fp8", 2048, 768), ("mxfp4", 2048, 768), ("fp4", 2048, 768),
                            ("mxfp4", 2880, 2880), ("fp4", 4096, 2048)):
    row = dequant_vs_upload(method, 8, hidden, ffn, cuda)
    print(json.dumps({"tree": sys.argv[1], "round": int(sys.argv[2]), "hidden": hidden,
                      "ffn": ffn, **row}))
PY
    ) >> $OUT/dequant.jsonl 2>> $OUT/errors.log
  done
done
python3 - $OUT/dequant.jsonl <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
for key in sorted({(r["format"], r["hidden"], r["ffn"]) for r in rows}):
    for tree in ("base", "head"):
        mine = [r for r in rows if (r["format"], r["hidden"], r["ffn"]) == key and r["tree"] == tree]
        if mine:
            print(*key, tree, "device ms", statistics.median(r["dequant_device_ms"] for r in mine),
                  "device/upload", statistics.median(r["dequant_device_over_upload"] for r in mine),
                  "with host/upload", statistics.median(r["dequant_over_upload"] for r in mine))
PY
