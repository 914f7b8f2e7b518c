import sys

from macs_kernels.apps.cli import main

sys.exit(main())
