"""``python -m jaxkv.train``: training entry points.

Subcommands:
    distillcache  train the DistillCache eviction policy (REINFORCE, teacher/student caches)
    kvlearn       pre-train KVLearn's reuse predictor offline on a trace
"""

from __future__ import annotations

import sys

USAGE = (
    "usage: python -m jaxkv.train {distillcache,kvlearn} [options]  (add --help after a subcommand)"
)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "distillcache":
        from jaxkv.rl.driver import main as distillcache_main

        return distillcache_main(argv[1:])
    if argv and argv[0] == "kvlearn":
        from jaxkv.kvlearn.cli import train_main

        return train_main(argv[1:])
    print(USAGE, file=sys.stderr)
    return 0 if argv and argv[0] in ("-h", "--help") else 2


if __name__ == "__main__":
    sys.exit(main())
