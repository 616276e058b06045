import sys

from tools.warmup import main

sys.exit(main())
