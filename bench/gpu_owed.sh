#!/usr/bin/env bash
# One device call (DEADLINE seconds, default 560) for the runs earlier notes left owed, in
# priority order (STEPS picks which), each step's files tarred into $OUT as it ends (a cut
# call keeps them):
#   tests  the GPU tests (-m gpu) of the streaming session, the kernels, the stages, the API
#          on CuPy (wait_uploads, DLPack), the transformers path without a sync, quantized
#          layers held whole and the dequantization kernels' batches (the graphs' tests)
#   cost   bench.held_cost on a --spread BF16 model of Qwen3-30B-A3B's layer shape, 8 layers,
#          3 GiB: a held token's experts calls, its start and end and the rest of its wall
#          time, unprofiled, beside the resident model's (5 rounds); the experts calls split
#          into the whole-layer path and its gather launch (--split-calls); a third arm
#          ends each held token at the next one's end, not several together (held_0); a
#          fourth launches the decode steps' experts calls as they are, not replayed as
#          CUDA graphs as shipped (held_graphs_off)
#   launch bench.launch_cost: the gather launch's host time and its parts beside torch's own
#          index launch, in a tight loop
#   dispatch  bench.dispatch on that model (auto, then direct mode): the resident model's
#          speed as each part of a session enters the process (CuPy, device allocations,
#          registered host memory, moestream's model held whole, its close)
#   held   bench.transformers resident,held on that model in HELD separate processes
#          (default 3), HELD_ROUNDS rounds each (default 5: a round's ratio spreads 0.8-1.3
#          on an H100): x_resident and whole_share per process
#   warm   bench.transformers resident,warm,predict,in_place,cold on that model at 3 GiB in
#          all, three rounds: the issue's page-cache warm and cold figures, with and without
#          prefetch, and with the misses read in place
#   forwards  bench.forwards on that model at 3 GiB: a 2048-token prefill, a 4-token
#          verification forward against a 1-token one, prompt lookup and a 1-layer draft
#   tf     the other transformers GPU tests (dequantizers, every model kind on CUDA), more
#          than one step can hold
#   qgraphs  bench.quantized on the --spread FP8 model of that shape held whole against
#          transformers' dequantized resident one, three rounds, graphs off then on
#          (two processes)
#   profile  bench.experts_profile on that model held whole, the resident model first in the
#          same process, other threads sampled, one generate on the torch profiler's timeline:
#          where a held token's host time goes beside the resident model's
#   newer  with transformers as on this dev machine (its wheels carried in .whl/newer by
#          bench/gpu_newer_wheels.sh, installed apart in /tmp/site-newer), bench.archs
#          --device cuda on the model types the GPU machine's transformers lacks (NEWER_KINDS)
# GRAPHS=on or off sets the held and warm runs' CUDA graphs (bench.transformers --graphs;
# default: as shipped).
# Usage (GPU machine, repo root, .whl carried): STEPS=tests,held bash bench/gpu_owed.sh
set -u
DEADLINE=${DEADLINE:-560} R=/tmp/r-owed
source bench/gpu_steps.sh
cp $R/machine.txt $OUT/
tarred() {  # name, seconds, command...: the step's log and files in $R/NAME return tarred
  step "$@"
  cp $R/steps.txt $OUT/ && tar czf $OUT/$1.tgz -C $R $1.log $(ls -d $R/$1 2>/dev/null | xargs -r -n1 basename) || true
}
M=/tmp/q/bf16-qwen3-30b-a3b-8-spread
made() {  # the model every step after tests shares, made once a lease
  [[ -f $M/config.json ]] || step make 150 python3 -m bench.transformers --make $M \
    --shape qwen3-30b-a3b --layers 8 --spread --total 3GiB --tokens 8 --repeat 1 --runs resident
}
steps=${STEPS:-tests,held}
graphs=${GRAPHS:+--graphs $GRAPHS}  # GRAPHS=on|off: the held and warm runs' decode graphs
if [[ $steps == *tests* ]]; then
  tarred tests 300 python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/streaming tests/gpu \
    tests/stages tests/api tests/transformers/test_transformers_nosync.py \
    tests/transformers/test_whole_quantized.py tests/transformers/test_dequant_batch_cuda.py
  tail -3 $R/tests.log
fi
if [[ $steps == *cost* ]]; then
  made
  mkdir -p $R/cost
  tarred cost 150 python3 -m bench.held_cost -m $M --device cuda --tokens 32 --rounds 5 --split-calls \
    --other-graphs --held-tokens 0 --out $R/cost/held_cost.json
fi
if [[ $steps == *launch* ]]; then
  mkdir -p $R/launch
  tarred launch 60 python3 -m bench.launch_cost --out $R/launch/launch_cost.json
fi
if [[ $steps == *dispatch* ]]; then
  made
  for mode in auto direct; do
    mkdir -p $R/dispatch-$mode
    tarred dispatch-$mode 150 python3 -m bench.dispatch -m $M --mode $mode \
      --out $R/dispatch-$mode/dispatch.json
  done
fi
if [[ $steps == *held* ]]; then
  mkdir -p $R/held
  for i in $(seq ${HELD:-3}); do
    tarred held 200 python3 -m bench.transformers --make $M \
      --shape qwen3-30b-a3b --layers 8 --spread --total 3GiB --tokens 32 --repeat 1 \
      --rounds ${HELD_ROUNDS:-5} --runs resident,held $graphs --out $R/held/process$i.json
    python3 - $R/held/process$i.json <<'PY' | tee -a $R/steps.txt
import json, sys
d = json.load(open(sys.argv[1]))
for name, run in d.get("runs", {}).items():
    each = run.get("rounds", [run])
    print(" ", sys.argv[1].rsplit("/", 1)[-1], name, run.get("x_resident"),
          [(r.get("tokens_per_s"), r.get("x_resident"), r.get("whole_share"),
            r.get("graph_replays")) for r in each],
          "same_tokens", run.get("same_tokens"))
PY
  done
  cp $R/steps.txt $OUT/
fi
if [[ $steps == *warm* ]]; then
  made
  mkdir -p $R/warm
  tarred warm 300 python3 -m bench.transformers -m $M --total 3GiB --tokens 32 --repeat 1 \
    --rounds 3 --runs resident,warm,predict,in_place,cold $graphs --out $R/warm/warm.json
fi
if [[ $steps == *forwards* ]]; then
  made
  mkdir -p $R/forwards
  tarred forwards 300 python3 -m bench.forwards -m $M --total 3GiB --repeat 3 --device cuda \
    --out $R/forwards/forwards.json
fi
if [[ $steps == *tf* ]]; then
  tarred tf 300 python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/transformers \
    --ignore=tests/transformers/test_transformers_nosync.py \
    --ignore=tests/transformers/test_whole_quantized.py \
    --ignore=tests/transformers/test_dequant_batch_cuda.py
  tail -3 $R/tf.log
fi
if [[ $steps == *qgraphs* ]]; then
  mkdir -p $R/qgraphs
  for g in off on; do
    tarred qgraphs 240 python3 -m bench.quantized --make /tmp/q/quantized --format fp8 \
      --shape qwen3-30b-a3b --layers 8 --spread --tokens 32 --repeat 1 --rounds 3 \
      --runs reference,fp8_all --graphs $g --out $R/qgraphs/graphs-$g.json
  done
fi
if [[ $steps == *profile* ]]; then
  made
  mkdir -p $R/profile
  tarred profile 300 python3 -m bench.experts_profile -m $M --device cuda --tokens 32 --top 70 \
    --resident --threads --timeline --out $R/profile/profile.txt
fi
if [[ $steps == *newer* ]]; then
  mkdir -p $R/newer
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-newer \
    .whl/newer/*.whl 2>/dev/null
  (export PYTHONPATH=/tmp/site-newer:$PYTHONPATH
   tarred newer 200 python3 -m bench.archs --device cuda \
     --kinds ${NEWER_KINDS:-inkling2,inkling2_loop,qwen3_5_moe} --out $R/newer/archs.json)
fi
cat $R/steps.txt
