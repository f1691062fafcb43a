"""The command lines: the only place jaxkv parses flags (``argparse``).

Each module parses its flags and calls one library function: ``eval`` (``python -m
jaxkv.eval``: ``generate`` and the dispatch to the rest), ``suite`` (the evaluation suite's
subcommands), ``train`` (``python -m jaxkv.train``) and ``kvlearn`` (the KVLearn simulators).
"""
