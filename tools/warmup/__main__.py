import sys

from moestream.tools.warmup import command

sys.exit(command())
