"""`python -m tfrecompute ...`: the same as the `tfrecompute` command."""

import sys

from tfrecompute.cli.command import main

if __name__ == "__main__":
    sys.exit(main())
