import sys

from tools.warmup.cli import main

sys.exit(main())
