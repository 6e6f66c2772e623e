"""``python -m tokenline.fetch URI DIR``, the same as ``tokenline fetch`` once it is wired in."""

import sys

from tokenline.fetch.command import main

sys.exit(main())
