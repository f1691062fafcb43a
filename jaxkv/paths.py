"""Where jaxkv keeps files it makes on a machine (dequantized models, compiled programs and
kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$JAXKV_CACHE_DIR``, else ``~/.cache/jaxkv`` (``$XDG_CACHE_HOME/jaxkv`` when set)."""
    if env := os.environ.get("JAXKV_CACHE_DIR"):
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jaxkv"
