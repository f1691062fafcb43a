"""One checkpoint idiom for every kind of checkpoint: a pytree of arrays plus a JSON description.

A checkpoint is a directory with ``params/`` (the tree, written by orbax's synchronous
``StandardCheckpointHandler``) and a meta JSON file (``meta.json`` unless the caller names
another) holding the caller's meta and a ``checksum`` entry: the sha256 of every file under
``params/`` and of every array leaf (dtype, shape and bytes, keyed by the leaf's keypath).

Like gemma's ``gm.ckpts``, this module knows no model: ``restore`` gets the target tree from its
caller (``jax.eval_shape`` of the initializer). It verifies the files before orbax reads them and
the leaves after, and refuses non-finite floats; ``save`` refuses non-finite floats too. Every
failure is a one-line ``CheckpointError`` naming the checkpoint. Writes are atomic: the
checkpoint is written into a temporary sibling directory and renamed into place.

``TrainCheckpoints`` keeps the newest few training states as ``workdir/checkpoints/<step>``
and resumes from the newest intact one.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import uuid
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

META = "meta.json"
TREE = "params"
CHECKSUM = "checksum"  # the meta entry this module owns


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or read intact (one line: the path and the reason)."""

    def __init__(self, path: str | Path, reason: str, *, what: str = "checkpoint"):
        self.path = Path(path)
        self.reason = reason
        super().__init__(f"{what} {path}: {reason}")


def save(path: str | Path, tree: Any, meta: dict[str, Any], *, meta_name: str = META) -> Path:
    """Writes ``tree`` and ``meta`` (JSON-serializable) atomically to the directory ``path``.

    An existing checkpoint at ``path`` is replaced; any other existing non-empty directory
    is left alone.

    Raises:
        CheckpointError: a float leaf holds NaN or inf (nothing is written), or ``path`` is
            something other than a checkpoint.
    """
    path = Path(path).absolute()
    if CHECKSUM in meta:
        raise ValueError(f"meta entry {CHECKSUM!r} is reserved for the checkpoint's checksums")
    leaves = _leaf_digests(path, tree, on_nonfinite="refusing to save")
    if path.exists() and not (path.is_dir() and ((path / meta_name).is_file() or _empty(path))):
        raise CheckpointError(path, f"exists and is not a checkpoint ({meta_name}); not replacing")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.partial-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        _write_tree(tmp / TREE, tree)
        meta = json.loads(json.dumps(meta, default=_json_default))  # as restore will see it
        checksum = {
            "algorithm": "sha256",
            "meta": _sha256_meta(meta),
            "files": _file_digests(tmp),
            "leaves": leaves,
        }
        (tmp / meta_name).write_text(json.dumps({**meta, CHECKSUM: checksum}, indent=1))
        _move_into_place(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def read_meta(path: str | Path, *, meta_name: str = META) -> dict[str, Any]:
    """The meta a checkpoint was saved with (without verifying its arrays)."""
    return {k: v for k, v in _read_meta(Path(path).absolute(), meta_name).items() if k != CHECKSUM}


def restore(path: str | Path, abstract_tree: Any, *, meta_name: str = META) -> tuple[Any, dict]:
    """Reads the checkpoint at ``path`` into the structure of ``abstract_tree``: (tree, meta).

    Args:
        path: the checkpoint directory (from ``save``).
        abstract_tree: the target tree of ``jax.ShapeDtypeStruct`` (``jax.eval_shape``).
        meta_name: the meta file's name, as given to ``save``.

    Raises:
        CheckpointError: missing or unreadable files, a checksum mismatch, a tree that does
            not match ``abstract_tree``, or non-finite floats.
    """
    path = Path(path).absolute()
    meta = _read_meta(path, meta_name)
    checksum = meta.pop(CHECKSUM, None)
    if not isinstance(checksum, dict) or not {"meta", "files", "leaves"} <= set(checksum):
        raise CheckpointError(path, f"{meta_name} records no checksum (not written by save)")
    if _sha256_meta(meta) != checksum["meta"]:
        raise CheckpointError(path, f"checksum mismatch in {meta_name} (the file is damaged)")
    for rel, digest in checksum["files"].items():
        file = path / rel
        if not file.is_file():
            raise CheckpointError(path, f"missing file {rel}")
        if _sha256_file(file) != digest:
            raise CheckpointError(path, f"checksum mismatch in {rel} (the file is damaged)")
    try:
        ckptr = ocp.Checkpointer(ocp.StandardCheckpointHandler())
        tree = ckptr.restore(path / TREE, args=ocp.args.StandardRestore(abstract_tree))
    except Exception as e:  # orbax raises many types for foreign or mismatched trees
        raise CheckpointError(path, f"cannot read {TREE}/: {_first_line(e)}") from None
    leaves = _leaf_digests(path, tree, on_nonfinite="holds")
    if leaves.keys() != checksum["leaves"].keys():
        raise CheckpointError(path, "its tree does not match the requested structure")
    for key, digest in leaves.items():
        if checksum["leaves"][key] != digest:
            raise CheckpointError(path, f"checksum mismatch in array {key}")
    return tree, meta


class TrainCheckpoints:
    """Training-state checkpoints ``workdir/checkpoints/<step>``; the newest ``keep`` are kept."""

    def __init__(self, workdir: str | Path, *, keep: int = 2):
        self.dir = Path(workdir).absolute() / "checkpoints"
        self.keep = keep

    def steps(self) -> list[int]:
        """Steps with a checkpoint directory (intact or not), ascending."""
        if not self.dir.is_dir():
            return []
        return sorted(int(p.name) for p in self.dir.iterdir() if p.name.isdigit() and p.is_dir())

    def save(self, step: int, state: Any) -> None:
        """Saves ``state`` as ``step``; drops older checkpoints and any after ``step``.

        Checkpoints after ``step`` are from a timeline a resume abandoned (damaged ones).
        """
        for partial in self.dir.glob(".*.partial-*"):  # left by a save that was killed
            shutil.rmtree(partial, ignore_errors=True)
        target = self.dir / str(step)
        if target.exists() and not (target / META).is_file():
            shutil.rmtree(target)  # a damaged checkpoint of this step
        save(target, state, {"step": step})
        steps = self.steps()
        older = [s for s in steps if s < step]
        stale = [s for s in steps if s > step] + older[: max(0, len(older) + 1 - self.keep)]
        for s in stale:
            shutil.rmtree(self.dir / str(s), ignore_errors=True)

    def restore(self, abstract_state: Any) -> tuple[Any, int, list[CheckpointError]]:
        """The newest intact state: (state, step, errors of the newer damaged checkpoints).

        Returns (None, 0, []) when there is no checkpoint.

        Raises:
            CheckpointError: there are checkpoints, but none is intact.
        """
        damaged = []
        for step in reversed(self.steps()):
            try:
                state, _ = restore(self.dir / str(step), abstract_state)
            except CheckpointError as e:
                damaged.append(e)
                continue
            return state, step, damaged
        if damaged:
            reasons = "; ".join(f"step {e.path.name}: {e.reason}" for e in damaged)
            raise CheckpointError(self.dir, f"no intact checkpoint ({reasons})")
        return None, 0, []


def _write_tree(directory: Path, tree: Any) -> None:
    ckptr = ocp.Checkpointer(ocp.StandardCheckpointHandler())
    ckptr.save(directory, args=ocp.args.StandardSave(tree))


def _move_into_place(tmp: Path, path: Path) -> None:
    """Renames ``tmp`` to ``path``, replacing an existing checkpoint only once ``tmp`` is whole."""
    if not path.exists():
        tmp.rename(path)
        return
    old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
    path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)


def _read_meta(path: Path, meta_name: str) -> dict[str, Any]:
    if not path.is_dir():
        raise CheckpointError(path, "not a directory" if path.exists() else "no such directory")
    file = path / meta_name
    if not file.is_file():
        raise CheckpointError(path, f"missing {meta_name} (not a checkpoint, or an unfinished one)")
    try:
        meta = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(path, f"unreadable {meta_name}: {_first_line(e)}") from None
    if not isinstance(meta, dict):
        raise CheckpointError(path, f"{meta_name} is not a JSON object")
    return meta


def _leaf_digests(path: Path, tree: Any, *, on_nonfinite: str) -> dict[str, str]:
    """{keypath: sha256(dtype, shape, bytes)} of every leaf; non-finite floats raise."""
    digests = {}
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        key = jax.tree_util.keystr(keypath)
        a = np.ascontiguousarray(np.asarray(leaf))
        if jax.dtypes.issubdtype(a.dtype, np.inexact) and not np.all(np.isfinite(a)):
            raise CheckpointError(path, f"{on_nonfinite} non-finite values in array {key}")
        h = hashlib.sha256(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())
        digests[key] = h.hexdigest()
    return digests


def _sha256_meta(meta: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()


def _file_digests(root: Path) -> dict[str, str]:
    return {
        f.relative_to(root).as_posix(): _sha256_file(f)
        for f in sorted(root.rglob("*"))
        if f.is_file()
    }


def _sha256_file(file: Path) -> str:
    h = hashlib.sha256()
    with file.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _empty(directory: Path) -> bool:
    return not any(directory.iterdir())


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


def _json_default(x: Any) -> Any:
    if isinstance(x, np.generic | np.ndarray | jax.Array):
        return np.asarray(x).tolist()
    raise TypeError(f"{type(x).__name__} is not JSON-serializable")
