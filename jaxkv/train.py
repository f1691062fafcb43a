"""``python -m jaxkv.train``: see ``jaxkv.cli.train``."""

import sys

from jaxkv.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
