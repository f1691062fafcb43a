"""Checkpoints through orbax: policy files and resumable training state.

A policy checkpoint is a directory with ``params/`` (orbax) and ``policy.json`` (what it is,
how it was trained). Training state goes through an orbax ``CheckpointManager``, restored
into an abstract tree from ``jax.eval_shape`` so that a resume has the exact structure.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

POLICY_META = "policy.json"


def save_policy(path: str | Path, params: dict, meta: dict[str, Any]) -> Path:
    """Writes a policy checkpoint (overwriting one at ``path``)."""
    from jaxkv.policies.learned import count

    path = Path(path).absolute()
    path.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path / "params", params, force=True)
        ckptr.wait_until_finished()
    hidden = params["Dense_0"]["kernel"].shape[-1]
    meta = {"kind": "distillcache-policy", "hidden": hidden, "n_params": count(params), **meta}
    (path / POLICY_META).write_text(json.dumps(meta, indent=1))
    return path


def load_policy(path: str | Path) -> tuple[dict, dict]:
    """Reads a policy checkpoint: (params, meta).

    Raises:
        FileNotFoundError: no checkpoint at ``path``.
        ValueError: the directory is not a policy checkpoint or its files are corrupt.
    """
    from jaxkv.policies.learned import init_mlp

    path = Path(path).absolute()
    meta_file = path / POLICY_META
    if not meta_file.is_file():
        raise FileNotFoundError(f"no policy checkpoint at {path} (missing {POLICY_META})")
    try:
        meta = json.loads(meta_file.read_text())
        hidden = int(meta["hidden"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{meta_file} is not a valid policy description: {e}") from None
    abstract = jax.eval_shape(lambda: init_mlp(key=jax.random.key(0), hidden=hidden))
    try:
        with ocp.StandardCheckpointer() as ckptr:
            params = ckptr.restore(path / "params", abstract)
    except Exception as e:  # orbax raises many types for truncated or foreign files
        raise ValueError(f"cannot read policy parameters in {path / 'params'}: {e}") from None
    return params, meta


class TrainCheckpoints:
    """Periodic, resumable training-state checkpoints in ``workdir/checkpoints``."""

    def __init__(self, workdir: str | Path, *, keep: int = 2):
        self.dir = Path(workdir).absolute() / "checkpoints"
        self.manager = ocp.CheckpointManager(
            self.dir, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state) -> None:
        self.manager.save(step, args=ocp.args.StandardSave(state))

    def restore(self, abstract_state):
        """The latest state, restored into ``abstract_state``'s structure (None if none)."""
        step = self.manager.latest_step()
        if step is None:
            return None
        return self.manager.restore(step, args=ocp.args.StandardRestore(abstract_state))

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
