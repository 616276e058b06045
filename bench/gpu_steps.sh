# Sourced by the one-call device scripts (gpu_call.sh, gpu_timeline.sh, gpu_in_place.sh)
# after they set R (their results folder) and DEADLINE (seconds): installs the carried
# wheels, sets PYTHONPATH, writes $R/machine.txt, and defines
#   step NAME SECONDS COMMAND...: COMMAND under `timeout SECONDS`, its output in $R/NAME.log,
#   its status in $R/steps.txt; left out when less than SECONDS are left of DEADLINE.
START=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mkdir -p $R
{ nvidia-smi -L; python3 -c 'import torch, transformers, cupy; print("torch", torch.__version__, "transformers", transformers.__version__, "cupy", cupy.__version__)'; } > $R/machine.txt
step() {
  local name=$1 limit=$2; shift 2
  local left=$(( DEADLINE - ($(date +%s) - START) ))
  if [ $left -lt $limit ]; then echo "$name skipped: $left s left" >> $R/steps.txt; return; fi
  local t0=$(date +%s)
  timeout $limit "$@" > $R/$name.log 2>&1
  echo "$name rc=$? in $(( $(date +%s) - t0 )) s" >> $R/steps.txt
}
