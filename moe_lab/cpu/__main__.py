"""``python -m moe_lab.cpu``: build the CPU plug-in's kernels ahead (``make install`` does)."""

import sys

from moe_lab.cpu.build import main

sys.exit(main())
