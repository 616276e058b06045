# Issue 26 item 4 on the H200: where `python -m tools.warmup FILE` spends its wall time against
# vmtouch, with Python's own files warm (as `bench.warmup` times it). Run from the repo root, .whl carried.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
dpkg -x .whl/vmtouch*.deb /tmp/vmt; export PATH=/tmp/vmt/usr/bin:$PATH
F=/tmp/w8.gguf
[ -f $F ] || python3 -m tools.make_model $F --preset ds4-flash-q2 --layers 4 --no-digests 2>&1 | tail -1
drop() { python3 -c "
import os; fd=os.open('$F', os.O_RDONLY); os.posix_fadvise(fd,0,0,os.POSIX_FADV_DONTNEED)"
  sync; echo 3 > /proc/sys/vm/drop_caches
  python3 -c "import tools.warmup.cli, psutil, stages.residency" ; }
for i in 1 2 3; do
  echo "--- round $i"
  drop; /usr/bin/time -f "timeline: %e s wall %U user %S sys" python3 bench/results/issue26-warmup/timeline.py $F 2>&1 | grep -v "GB  $" | tail -40
  drop; /usr/bin/time -f "timeline (every 50 ms): %e s wall" python3 bench/results/issue26-warmup/timeline.py $F
  drop; /usr/bin/time -f "cli: %e s wall %U user %S sys" python3 -m tools.warmup $F
  drop; /usr/bin/time -f "vmtouch: %e s wall %U user %S sys" vmtouch -qt $F
  drop; /usr/bin/time -f "python -c pass: %e s wall" python3 -c pass
done 2>&1
