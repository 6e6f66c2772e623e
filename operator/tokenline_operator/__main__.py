"""`python -m tokenline_operator`: the same as `tokenline operator`."""

import sys

from .cli import main

sys.exit(main())
