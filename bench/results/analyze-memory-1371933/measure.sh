# usage: measure.sh TREE LABEL N [extra args]
tree=$1; label=$2; n=$3; shift 3
cd $tree && /usr/bin/time -v /work/main/.venv/bin/python -m tools.analyze /tmp/am/log$n.jsonl "$@" --json > /tmp/am/out-$label-$n.json 2> /tmp/am/time-$label-$n.txt
echo "$label $n rc=$? $(grep -E 'Maximum resident|Elapsed' /tmp/am/time-$label-$n.txt | tr '\n' ' ')"
