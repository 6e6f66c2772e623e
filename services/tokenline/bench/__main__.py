"""`python -m tokenline.bench`: the same as `tokenline bench`."""

import sys

from tokenline.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
