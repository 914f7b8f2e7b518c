import sys

from macs_kernels.cli import main

sys.exit(main())
