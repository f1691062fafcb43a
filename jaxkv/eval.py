"""``python -m jaxkv.eval``: see ``jaxkv.cli.eval``."""

import sys

from jaxkv.cli.eval import main

if __name__ == "__main__":
    sys.exit(main())
