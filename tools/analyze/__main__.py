import sys

from moestream.tools.analyze.cli import main

sys.exit(main())
