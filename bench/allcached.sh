#!/usr/bin/env bash
# A/B of all-cached decode between this tree (.) and an older one unpacked in .old
# (git archive <sha> | tar -x -C .old), on a GPU lease after bench/gpu_session.sh made
# bench-model.gguf. Prints steady-state ms per token (tokens 80+) for each, twice.
M=$PWD/bench-model.gguf
timeout 60 python3 -m tools.warmup $M > /dev/null 2>&1
for i in 1 2; do for t in . .old; do
  n=$(basename $(cd $t; pwd))
  (cd $t && PYTHONPATH=/tmp/site:$PWD timeout 60 python3 -m pipeline.run -m $M -n 200 --mode resident \
     --compute fixed:0.57 --backend cupy --no-verify --log $OUT/ac-$n-$i.jsonl > /dev/null 2>&1)
  python3 -c "
import json; ev=[json.loads(l) for l in open('$OUT/ac-$n-$i.jsonl')]; t=[e for e in ev if e['event']=='token' and e['token']>=80]
w=sum(e['wall_ms'] for e in t)/len(t); c=sum(e['compute_ms'] for e in t)/len(t); s=sum(e['stall_ms'] for e in t)/len(t)
print('$n run $i: tokens', len(t), 'wall ms', round(w,2), 'compute ms', round(c,2), 'stall ms', round(s,2), 'tok/s', round(1000/w,1))" | tee -a $OUT/allcached.log
done; done
gzip -q $OUT/ac-*.jsonl
