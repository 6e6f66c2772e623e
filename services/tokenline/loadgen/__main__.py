"""`python -m tokenline.loadgen`: the same as `tokenline bench`."""

import sys

from tokenline.loadgen.cli import main

if __name__ == "__main__":
    sys.exit(main())
