"""`python -m tandem.services.cli ...`: the `tandem` command (tandem.services.cli.main)."""

import sys

from tandem.services.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
