"""What the KVLearn command lines share: checked argument types, output-path checks, progress
bars on stderr and tables whose columns grow with their values.

Every check here runs before any simulation, so a bad argument or an unwritable output costs
nothing: argument types raise ``argparse.ArgumentTypeError`` (argparse prints ``error: argument
FLAG: must be > 0, got -1`` and exits 2), ``check_output`` raises ``ValueError``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

PROGRESS_MIN_REQUESTS = 100_000
"""Requests (core: requests × policies; serving: block requests × policies) from which a replay
shows a progress bar."""
PROGRESS_MIN_BYTES = 4 * 2**20
"""Trace files from this size on (~60,000 lines of the core format, ~15,000 Mooncake
requests) show a loading progress bar."""


# ---- argument types -------------------------------------------------------------------------
def number(kind: type = float, *, gt=None, ge=None, lt=None, le=None) -> Callable[[str], float]:
    """An argparse type: ``kind(s)`` (finite for floats) within the given bounds, else an error
    naming the bound and the value (``must be > 0, got -1``)."""
    bounds = [(">", gt, lambda v, b: v > b), ("≥", ge, lambda v, b: v >= b)]
    bounds += [("<", lt, lambda v, b: v < b), ("≤", le, lambda v, b: v <= b)]
    what = "an integer" if kind is int else "a number"

    def parse(s: str):
        try:
            v = kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {s!r}") from None
        if not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {s}")
        for sign, b, ok in bounds:
            if b is not None and not ok(v, b):
                raise argparse.ArgumentTypeError(f"must be {sign} {b:g}, got {s}")
        return v

    parse.__name__ = kind.__name__
    return parse


def number_list(item: Callable[[str], float]) -> Callable[[str], list]:
    """An argparse type: a non-empty comma-separated list of ``item`` values."""

    def parse(s: str) -> list:
        values = [item(x) for x in s.split(",") if x.strip()]
        if not values:
            raise argparse.ArgumentTypeError(f"needs at least one value, got {s!r}")
        return values

    parse.__name__ = "list"
    return parse


# ---- outputs --------------------------------------------------------------------------------
def check_output(path: str | os.PathLike, *, flag: str, directory: bool = False) -> None:
    """Raises ValueError unless ``path`` can be written: a file (or, with ``directory``, a
    folder) that is not the other kind, whose nearest existing ancestor is a writable folder.
    Nothing is created."""
    p = Path(path)
    if not directory and (p.is_dir() or str(path).endswith(os.sep)):
        raise ValueError(f"{flag} {path}: is a directory; give a file path")
    if directory and p.exists() and not p.is_dir():
        raise ValueError(f"{flag} {path}: exists and is not a directory")
    if p.exists() and not os.access(p, os.W_OK):
        raise ValueError(f"{flag} {path}: not writable")
    parent = p.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{flag} {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: cannot create files in {parent} (not writable)")


# ---- progress -------------------------------------------------------------------------------
class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


def progress_bar(total: int, *, desc: str, unit: str, show: bool):
    """A tqdm bar on stderr (stdout stays clean for tables and JSON) if ``show``, else a no-op
    with the same ``update`` / ``close`` / context manager."""
    if not show:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=unit == "B",
        file=sys.stderr,
        dynamic_ncols=True,
        mininterval=0.5,
    )


def file_progress(path: str | os.PathLike, *, desc: str = "loading trace"):
    """``progress_bar`` over the bytes of ``path`` (a no-op for small or missing files)."""
    try:
        size = Path(path).stat().st_size
    except OSError:
        size = 0
    return progress_bar(size, desc=desc, unit="B", show=size >= PROGRESS_MIN_BYTES)


# ---- tables ---------------------------------------------------------------------------------
Column = tuple[str, int, Callable[[dict], str]]
"""(header, minimum width, cell text of a row); the first column is left-aligned."""


def format_columns(columns: Sequence[Column], rows: Sequence[dict], *, rule: bool = True) -> str:
    """A header, a rule (unless ``rule`` is false) and one line per row. Each column is as wide
    as its minimum width or its widest text plus one space, so wide values never run into their
    neighbours."""
    cells = [[text(r) for _, _, text in columns] for r in rows]
    widths = [
        max([w, len(head) + 1] + [len(c[j]) + 1 for c in cells])
        for j, (head, w, _) in enumerate(columns)
    ]

    def line(texts) -> str:
        first = f"{texts[0]:<{widths[0]}}"
        return first + "".join(f"{t:>{w}}" for t, w in zip(texts[1:], widths[1:], strict=True))

    head = line([h for h, _, _ in columns])
    return "\n".join([head] + ["-" * len(head)] * rule + [line(c) for c in cells])
