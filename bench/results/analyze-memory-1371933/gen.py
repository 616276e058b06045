"""Write the synthetic log of N tokens these figures were measured on: gen.py N."""

import sys
from pathlib import Path

from bench.analyze import SyntheticRun, write_synthetic_log

n = int(sys.argv[1])
print(write_synthetic_log(Path(f"/tmp/am/log{n}.jsonl"), SyntheticRun(tokens=n)))
