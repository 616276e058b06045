import sys

from tools.analyze.cli import main

sys.exit(main())
