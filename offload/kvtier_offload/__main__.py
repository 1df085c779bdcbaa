import sys

from kvtier_offload.cli import main

sys.exit(main())
