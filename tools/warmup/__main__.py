import sys

from tools.warmup import command

sys.exit(command())
