"""`python -m macs_kernels` is the `macs-kernels` command."""
import sys

from macs_kernels.apps.cli import main

sys.exit(main())
