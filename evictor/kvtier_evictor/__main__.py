import sys

from kvtier_evictor.cli import main

sys.exit(main())
