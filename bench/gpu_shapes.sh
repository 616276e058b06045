#!/usr/bin/env bash
# H200 leases (repo root on the GPU machine, .whl carried): every shape at its limit.
# Steps, comma-separated (default: api,warmup,gaps):
#   tests     the GPU tests (pytest -m gpu)
#   api       python -m bench.api_calls on the tiny preset (sync vs async per call)
#   warmup    python -m bench.warmup --size-gib 8 --runs 3, and numpy's import CPU with and
#             without OPENBLAS_NUM_THREADS=1
#   gaps      bench.gaps (device idle per token, all cached) on each shape
#   pipeline  bench.pipeline --skip cold on each shape, RUNS times (default 3)
#   contention  bench.contention on each shape (GATHER_BLOCKS=N: the gather's SM budget)
#   register  python -m bench.register --size-gib 4 (copy engines by piece, strided copies)
#   strided   python -m bench.strided (an expert's slices as one copy across registrations)
#   hostcost  the host's time a layer on a 4-layer fine file: bench.hostpath (stand-in device)
#             and bench.profile --backend cupy (timed twice, then under cProfile, which
#             counts CuPy's calls as functions too), gather and --no-gather; then the
#             direct path (bench.profile --phase direct-miss: O_DIRECT into staging, the
#             loop sharing the GIL with the readers), timed and under cProfile
#   dmaload   topology (lscpu, nvidia-smi topo), then bench.hostpath on the 4-layer fine file
#             alone and beside bench.dmaload's host -> device traffic (copy engines, gather):
#             whether the device's reads of host memory slow the host's Python
#   cpus      bench.cpus (the same Python timed on every CPU, shuffled rounds) alone and
#             beside bench.dmaload's gather traffic: whether some vCPUs are slower
#   spy       one warm-miss-only bench.pipeline per shape under py-spy (--native --idle,
#             raw stacks per thread; py-spy's wheel carried in .whl): where the loop
#             thread's time goes when a round runs slow
# Shapes (SHAPES, default qwen,dsv2,fine): Qwen3-30B-A3B (48 x 128, top-8, 2.5 MiB experts),
# DeepSeek-V2-Lite's plan (26 x 64, top-6, 6.2 MiB), Qwen3-Next-like fine-grained (20 x 512,
# top-10, 1.7 MiB); files made here by moestream.tools.make_model --no-digests (no recorded digests:
# moestream.tools.warmup --digests builds each one's manifest first) and kept in $MODELS between calls
# of one lease.
# NOLOG=1: gaps without the run log too; PROFILE=1: bench.profile's all-cached phase too;
# SKIP=phases: bench.pipeline's --skip (default cold); EXTRA: more bench.pipeline options
# (EXTRA=--copy-timeline: each warm-miss round's copies timed on the device, bench.copytimes).
# NAIVE_TOKENS=N: the naive reference's tokens (16; at 8 it swung 2.04-2.64 tok/s on the fine
# shape within one lease while the cache run held 5.68-5.80, shapes-h200-9504844/). PASSES=N: bench.pipeline's sweep passes (default 4: 24 measured tokens a warm-miss round,
# ~0.25 s on the fine shape, whose rounds swung 29-48 GB/s within one run at 40b54b0).
# Usage: STEPS=pipeline SHAPES=fine RUNS=3 bash bench/gpu_shapes.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XDG_CACHE_HOME=/tmp/cache
MODELS=${MODELS:-/tmp/models}; mkdir -p $MODELS
FINAL=$OUT; OUT=/tmp/out-shapes; rm -rf $OUT; mkdir -p $OUT  # at most 8 files come back: one tar
pack() { tar -czf $FINAL/results.tgz -C $OUT .; }  # after every step: a cut run keeps them
trap pack EXIT
steps=${STEPS:-api,warmup,gaps}; shapes=${SHAPES:-qwen,dsv2,fine}
echo "commit ${MOESTREAM_COMMIT:-unknown}"; nvidia-smi -L; nproc; free -g | head -2; df -h /tmp | tail -1
model() {  # model SHAPE: the file, made once
  local m=$MODELS/$1.gguf
  if [[ ! -f $m ]]; then
    case $1 in
      qwen) python3 -m tools.make_model $m --preset qwen3-30b-a3b --no-digests | tail -1 ;;
      dsv2) python3 -m tools.make_model $m --preset deepseek-v2-lite --no-digests | tail -1 ;;
      fine) python3 -m tools.make_model $m --preset qwen3-next-80b-a3b --layers 20 --no-digests | tail -1 ;;
    esac
    python3 -m tools.warmup $m --digests > /dev/null 2>&1  # resident, and its manifest built
  fi >&2
  echo $m
}
if [[ $steps == *tests* ]]; then
  timeout 240 python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests > $OUT/gpu-tests.log 2>&1
  rc=$?; echo "gpu tests rc=$rc" | tee -a $OUT/gpu-tests.log; tail -4 $OUT/gpu-tests.log
fi
if [[ $steps == *api* ]]; then
  python3 -m tools.make_model /tmp/tiny.gguf --preset tiny > /dev/null 2>&1
  timeout 120 python3 -m bench.api_calls /tmp/tiny.gguf --rounds 3000 --out $OUT/api-calls.json \
    > $OUT/api-calls.log 2>&1; echo "api_calls rc=$?"; tail -12 $OUT/api-calls.log
fi
if [[ $steps == *register* ]]; then
  timeout 200 python3 -m bench.register --size-gib 4 --dir /tmp --out $OUT/register.json \
    > $OUT/register.log 2>&1; echo "register rc=$?"; grep -A30 strided $OUT/register.log | head -12
  pack
fi
if [[ $steps == *strided* ]]; then
  timeout 200 python3 -m bench.strided --dir /tmp --out $OUT/strided.json > $OUT/strided.log 2>&1
  echo "strided rc=$?"; tail -6 $OUT/strided.log; pack
fi
if [[ $steps == *warmup* ]]; then
  # vmtouch is not installed there: its Debian package travels in .whl (apt-get download)
  for d in .whl/vmtouch*.deb; do dpkg -x $d /tmp/vmtouch && export PATH=/tmp/vmtouch/usr/bin:$PATH; done
  for v in unset 1; do
    ( [[ $v == 1 ]] && export OPENBLAS_NUM_THREADS=1
      /usr/bin/time -f "import numpy OPENBLAS_NUM_THREADS=$v: %e s wall %U s user %S s sys" \
        python3 -c "import numpy" ) 2>&1 | tail -1
  done | tee $OUT/numpy-import.log
  timeout 300 python3 -m bench.warmup --size-gib 8 --runs 3 --dir /tmp --out $OUT/warmup.json \
    > $OUT/warmup.log 2>&1; echo "warmup rc=$?"; tail -14 $OUT/warmup.log; pack
fi
if [[ $steps == *hostcost* ]]; then
  m=$MODELS/fine4.gguf
  [[ -f $m ]] || { python3 -m tools.make_model $m --preset qwen3-next-80b-a3b --layers 4 --no-digests
                   python3 -m tools.warmup $m --digests; } > /dev/null 2>&1
  for g in "" --no-gather; do
    echo "hostcost ${g:-gather}:"
    timeout 120 python3 -m bench.hostpath --model $m --repeats 5 $g 2>&1 | grep -E "hit|miss"
    for i in 1 2; do
      timeout 60 python3 -m bench.profile --model $m --phase resident-miss --backend cupy \
        --no-profile $g 2>&1 | grep "us/layer"
    done
    timeout 120 python3 -m bench.profile --model $m --phase resident-miss --backend cupy --top 70 \
      $g > $OUT/hostcost-profile${g:--gather}.log 2>&1; grep "us/layer" $OUT/hostcost-profile${g:--gather}.log
  done | tee $OUT/hostcost.log
  { echo "hostcost direct:"
    timeout 120 python3 -m bench.profile --model $m --phase direct-miss --backend cupy --no-profile \
      2>&1 | grep "us/layer"
    timeout 120 python3 -m bench.profile --model $m --phase direct-miss --backend cupy --top 70 \
      > $OUT/hostcost-profile-direct.log 2>&1; grep "us/layer" $OUT/hostcost-profile-direct.log
  } | tee -a $OUT/hostcost.log; pack
fi
if [[ $steps == *dmaload* ]]; then
  m=$MODELS/fine4.gguf
  [[ -f $m ]] || { python3 -m tools.make_model $m --preset qwen3-next-80b-a3b --layers 4 --no-digests
                   python3 -m tools.warmup $m --digests; } > /dev/null 2>&1
  { lscpu | grep -E "Model name|^CPU\(s\)|NUMA|MHz|Thread|Socket"; nvidia-smi topo -m; } > $OUT/topology.log 2>&1
  for load in none copy gather none; do
    if [[ $load != none ]]; then
      python3 -m bench.dmaload --mode $load --seconds 40 > $OUT/dmaload-$load.log 2>&1 & pid=$!; sleep 4
    fi
    echo "hostpath beside $load:"; timeout 60 python3 -m bench.hostpath --model $m --repeats 5 2>&1 | grep -E "hit|miss"
    if [[ $load != none ]]; then wait $pid; cat $OUT/dmaload-$load.log; fi
  done | tee $OUT/dmaload.log; pack
fi
if [[ $steps == *cpus* ]]; then
  { nproc; timeout 120 python3 -m bench.cpus --rounds 7 --out $OUT/cpus.json
    python3 -m bench.dmaload --mode gather --seconds 60 > $OUT/dmaload-cpus.log 2>&1 & pid=$!; sleep 4
    echo "beside the gather's traffic:"; timeout 120 python3 -m bench.cpus --rounds 7 --out $OUT/cpus-dma.json
    wait $pid; cat $OUT/dmaload-cpus.log; } 2>&1 | tee $OUT/cpus.log; pack
fi
for s in ${shapes//,/ }; do
  [[ $steps == *gaps* || $steps == *pipeline* || $steps == *contention* || $steps == *spy* ]] || break
  m=$(model $s)
  if [[ $steps == *gaps* ]]; then
    for extra in "" ${NOLOG:+--no-log}; do
      timeout 60 python3 -m bench.gaps --model $m --backend cupy $extra \
        --out $OUT/gaps-$s${extra:+-nolog}.json 2>&1 | tail -6
    done
    [[ -n ${PROFILE:-} ]] && timeout 60 python3 -m bench.profile --model $m --backend cupy --phase all-cached --top 40 \
      > $OUT/profile-$s.log 2>&1 && grep "us/layer" $OUT/profile-$s.log
  fi
  if [[ $steps == *spy* ]]; then
    timeout 200 /tmp/site/bin/py-spy record --native --idle --threads -r 200 -f raw \
      -o $OUT/spy-$s.txt -- python3 -m bench.pipeline --model $m --backend cupy \
      --skip cold,cache,all --lookahead 8 --out $OUT/spy-$s.json > $OUT/spy-$s.log 2>&1
    echo "spy $s rc=$?"; grep -E "^  [0-9]_" $OUT/spy-$s.log; pack
  fi
  if [[ $steps == *pipeline* ]]; then
    for r in $(seq 1 ${RUNS:-3}); do
      timeout 200 python3 -m bench.pipeline --model $m --backend cupy --skip ${SKIP:-cold} --naive-tokens ${NAIVE_TOKENS:-16} \
        --lookahead 8 ${PASSES:+--passes $PASSES} ${EXTRA:-} --out $OUT/pipeline-$s-run$r.json \
        > $OUT/pipeline-$s-run$r.log 2>&1
      echo "pipeline $s run $r rc=$?"; grep -E "^  [0-9]_" $OUT/pipeline-$s-run$r.log; pack
    done
  fi
  if [[ $steps == *contention* ]]; then
    c=contention-$s${GATHER_BLOCKS:+-blocks$GATHER_BLOCKS}
    timeout 200 python3 -m bench.contention --model $m --backend cupy --rounds 2 --engine-s 2 \
      ${GATHER_BLOCKS:+--gather-blocks $GATHER_BLOCKS} --out $OUT/$c.json > $OUT/$c.log 2>&1
    echo "$c rc=$?"; tail -9 $OUT/$c.log; pack
  fi
done
