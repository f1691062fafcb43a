"""The data jaxkv ships, and how its files are read.

This package holds the small public data the main job, the evaluation suite and training read
(each folder with its licence): ``tinyshakespeare/`` (text for fidelity and training),
``gsm8k/`` (train, test and the 8 chain-of-thought exemplars), ``bbh/`` (27 BIG-Bench Hard tasks
and their 3-shot prompts), ``longbench/config/`` (templates and metrics; LongBench's data itself
is not shipped) and ``mooncake_traces/synthetic_trace.jsonl`` (the Mooncake example trace).
See ``README.md`` here for sources and licences.

The data folder is this package (found with ``importlib.resources``, so it works from a wheel),
unless the environment variable ``JAXKV_DATA_DIR`` names another folder with the same layout;
every loader also takes an explicit ``data_dir`` / path argument, which wins over both.
"""

from __future__ import annotations

import importlib.resources
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DATA_DIR_ENV = "JAXKV_DATA_DIR"
MOONCAKE_EXAMPLE = "mooncake_traces/synthetic_trace.jsonl"
"""The shipped Mooncake example trace, relative to the data folder."""


def shipped_data_dir() -> Path:
    """The data folder inside the installed package."""
    return Path(str(importlib.resources.files(__name__)))


def default_data_dir() -> Path:
    """The data folder: ``$JAXKV_DATA_DIR`` if set, else the data shipped with jaxkv."""
    env = os.environ.get(DATA_DIR_ENV)
    if env:
        return Path(env)
    return shipped_data_dir()


def resolve_data_dir(data_dir: str | os.PathLike | None) -> Path:
    """``data_dir`` as a Path, or the default data folder when it is None."""
    return default_data_dir() if data_dir is None else Path(data_dir)


def data_file(relative: str, *, data_dir: str | os.PathLike | None = None) -> Path:
    """``relative`` (e.g. ``"gsm8k/test.jsonl"``) inside the data folder, checked to exist."""
    return require_file(resolve_data_dir(data_dir) / relative)


def require_file(path: str | os.PathLike) -> Path:
    """``path`` as a Path after checking that it is an existing file.

    Raises:
        FileNotFoundError: naming the path (and the env var that moves the data folder).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"data file not found: {path} (set {DATA_DIR_ENV} or pass the path explicitly)"
        )
    return path


def read_text(path: str | os.PathLike) -> str:
    """The UTF-8 text of an existing file (FileNotFoundError naming the path if missing)."""
    return require_file(path).read_text(encoding="utf-8")


def read_json(path: str | os.PathLike) -> Any:
    """A parsed JSON file.

    Raises:
        FileNotFoundError: missing file.
        ValueError: invalid JSON, with the file and position.
    """
    path = require_file(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: invalid JSON at line {err.lineno}: {err.msg}") from err


def read_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, dict]]:
    """Yields ``(line_number, record)`` for each non-blank line of a JSON-lines file.

    Line numbers start at 1. Lines are parsed lazily, so records before a bad line are yielded
    first.

    Raises:
        FileNotFoundError: missing file.
        ValueError: a line that is not a JSON object, naming the file and the line number.
    """
    path = require_file(path)
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: malformed JSON line: {err.msg}") from err
            if not isinstance(record, dict):
                kind = type(record).__name__
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {kind}")
            yield lineno, record
