"""``python -m moe_lab.workbench.cpu``: build the CPU plug-in's kernels ahead (``make install`` does)."""

import sys

from moe_lab.workbench.cpu.build import main

sys.exit(main())
