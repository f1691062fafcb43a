"""The evaluation suite as a library: prompts (``tasks``, ``hub``), scores (``metrics``), the
evaluations (``fidelity``, ``retrieval``, ``benchmarks``, ``agreement``, ``positions``,
``latency``; each with an ``evaluate`` job), the shared model plumbing (``runner``) and result
files (``report``). Its command line is ``jaxkv.cli.suite``."""
