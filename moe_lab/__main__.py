"""``python -m moe_lab``: the command line, which lives in the workbench (`moe_lab.workbench.cli`)."""

import sys

from moe_lab.workbench.cli import main

if __name__ == "__main__":
    sys.exit(main())
