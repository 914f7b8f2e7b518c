import sys

from macs_kernels.apps.serve.cli import main

sys.exit(main())
