"""Saving and restoring a (pre-trained) PRP with orbax.

A checkpoint directory holds one step (0) with two items: ``prp`` (the whole ``PRPState``:
parameters, Adam state, whitening statistics, replay buffer) and ``meta`` (JSON: the
``PRPConfig`` it was built with, the version of the feature definitions it was trained on, plus
free-form training info).
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from jaxkv.kvlearn import features as F
from jaxkv.kvlearn import prp as prp_lib


def save_prp(
    path: str | Path, state: prp_lib.PRPState, *, cfg: prp_lib.PRPConfig, info: dict | None = None
) -> None:
    """Writes ``state`` to ``path`` (created; an existing checkpoint there is replaced)."""
    path = Path(path).absolute()
    if path.exists():
        if not (path / "0").is_dir() and any(path.iterdir()):
            raise FileExistsError(f"{path} exists and is not a PRP checkpoint; not overwriting it")
        shutil.rmtree(path)
    meta = {
        "prp_config": dataclasses.asdict(cfg),
        "features_version": F.FEATURES_VERSION,
        "info": info or {},
    }
    with ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(max_to_keep=1)) as mngr:
        mngr.save(
            0,
            args=ocp.args.Composite(prp=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
            force=True,
        )
        mngr.wait_until_finished()


def load_prp(path: str | Path) -> tuple[prp_lib.PRPState, prp_lib.PRPConfig, dict]:
    """Restores (state, config, info) from a ``save_prp`` directory.

    The state is restored into the abstract tree of ``init_prp(config)`` (from
    ``jax.eval_shape``), so a mismatched checkpoint fails loudly, and so does one trained on
    another version of the features (``features.FEATURES_VERSION``; none recorded = 1).
    """
    path = Path(path).absolute()
    if not path.is_dir():
        raise FileNotFoundError(f"PRP checkpoint directory not found: {path}")
    with ocp.CheckpointManager(path) as mngr:
        step = mngr.latest_step()
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {path}")
        meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        version = meta.get("features_version", 1)
        if version != F.FEATURES_VERSION:
            raise ValueError(
                f"{path} holds a PRP trained on features version {version}; this jaxkv computes "
                f"version {F.FEATURES_VERSION}: re-train it (python -m jaxkv.train kvlearn)"
            )
        cfg = prp_lib.PRPConfig(**meta["prp_config"])
        abstract = jax.eval_shape(lambda: prp_lib.init_prp(cfg, key=jax.random.key(0)))
        restored = mngr.restore(
            step, args=ocp.args.Composite(prp=ocp.args.StandardRestore(abstract))
        )
    return restored.prp, cfg, meta.get("info", {})
