"""Saving and restoring a (pre-trained) PRP through ``jaxkv.checkpoint``.

The checkpoint's tree is the whole ``PRPState`` (parameters, Adam state, whitening statistics,
replay buffer); its meta (``meta.json``) holds the ``PRPConfig`` it was built with, the version
of the feature definitions it was trained on, and free-form training info.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax

from jaxkv import checkpoint as checkpoint_lib
from jaxkv.kvlearn.core import features as features_lib
from jaxkv.kvlearn.core import prp as prp_lib


def save_prp(
    path: str | Path, state: prp_lib.PRPState, *, cfg: prp_lib.PRPConfig, info: dict | None = None
) -> None:
    """Writes ``state`` to ``path`` (atomically replacing a checkpoint there).

    Raises:
        jaxkv.checkpoint.CheckpointError: ``path`` is a non-empty directory that is not a
            checkpoint, or the state holds non-finite values (nothing is written).
    """
    meta = {
        "prp_config": dataclasses.asdict(cfg),
        "features_version": features_lib.FEATURES_VERSION,
        "info": info or {},
    }
    checkpoint_lib.save(path, state, meta)


def load_prp(path: str | Path) -> tuple[prp_lib.PRPState, prp_lib.PRPConfig, dict]:
    """Restores and verifies (state, config, info) from a ``save_prp`` directory.

    The state is restored into the abstract tree of ``init_prp(config)`` (from
    ``jax.eval_shape``), so a mismatched checkpoint fails loudly, and so does one trained on
    another version of the features (``features.FEATURES_VERSION``; none recorded = 1).

    Raises:
        FileNotFoundError: no directory at ``path``.
        jaxkv.checkpoint.CheckpointError: not a PRP checkpoint, or a damaged one.
        ValueError: trained on another features version.
    """
    path = Path(path).absolute()
    if not path.is_dir():
        raise FileNotFoundError(f"PRP checkpoint directory not found: {path}")
    if (path / "0").is_dir() and not (path / checkpoint_lib.META).exists():
        raise checkpoint_lib.CheckpointError(
            path,
            "written by an older jaxkv (no checksum); re-train it (python -m jaxkv.train kvlearn)",
        )
    meta = checkpoint_lib.read_meta(path)
    version = meta.get("features_version", 1)
    if version != features_lib.FEATURES_VERSION:
        raise ValueError(
            f"{path} holds a PRP trained on features version {version}; this jaxkv computes "
            f"version {features_lib.FEATURES_VERSION}: re-train it (python -m jaxkv.train kvlearn)"
        )
    try:
        cfg = prp_lib.PRPConfig(**meta["prp_config"])
    except (KeyError, TypeError, ValueError) as e:
        raise checkpoint_lib.CheckpointError(path, f"invalid prp_config in meta: {e}") from None
    abstract = jax.eval_shape(lambda: prp_lib.init_prp(cfg, key=jax.random.key(0)))
    state, meta = checkpoint_lib.restore(path, abstract)
    return state, cfg, meta.get("info", {})
