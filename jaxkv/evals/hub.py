"""The full public evaluation sets, read with Hugging Face ``datasets`` (the optional ``hf`` extra).

``tasks`` reads the small copies jaxkv ships; the loaders here read the full public sets and
build the same ``tasks.Example`` records (same ids, prompts, targets and meta for the same rows):
the few-shot prompts and the LongBench templates still come from the shipped data.

* ``gsm8k_examples``: ``openai/gsm8k`` (config ``main``, splits ``test`` / ``train``).
* ``bbh_examples``: ``lukaemon/bbh`` (a config per task, split ``test``).
* ``longbench_examples``: ``THUDM/LongBench`` (a config per dataset, ``hotpotqa_e`` for
  LongBench-E, split ``test``).
* ``wikitext_text``: ``Salesforce/wikitext`` (``wikitext-103-raw-v1`` or ``wikitext-2-raw-v1``)
  as one text, one row per line, for ``tasks.text_windows``.

The suite reads them with ``python -m jaxkv.eval gsm8k|bbh --hub SOURCE``, ``longbench --hub
SOURCE --dataset NAME`` and ``fidelity --wikitext SOURCE``.

A ``source`` is a local file or folder, or else a hub name. A file is read as the split itself
(``.parquet``, ``.jsonl`` or ``.json``). A folder is searched for the config's split in the
layouts of ``LOCAL_LAYOUTS``, first match wins: a snapshot of the hub repository
(``main/test-00000-of-00001.parquet``), the hub's ``refs/convert/parquet`` branch
(``hotpotqa/test/0000.parquet``), or LongBench's ``data.zip`` unzipped (``data/hotpotqa.jsonl``).

A hub name goes through ``datasets.load_dataset``: with ``HF_HUB_OFFLINE=1`` it loads only what
the user's Hugging Face cache already holds (the tests run so and never download). LongBench on
the hub is a loading script, which ``datasets`` >= 4 no longer runs: unzip its ``data.zip`` and
pass the folder.
"""

from __future__ import annotations

import itertools
import os
import types
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from jaxkv.evals import tasks

if TYPE_CHECKING:
    import datasets

PathLike = str | os.PathLike

GSM8K_HUB = "openai/gsm8k"
GSM8K_CONFIG = "main"
BBH_HUB = "lukaemon/bbh"
LONGBENCH_HUB = "THUDM/LongBench"
WIKITEXT_HUB = "Salesforce/wikitext"
WIKITEXT_CONFIG = "wikitext-103-raw-v1"

MISSING_EXTRA = "the hub loaders need the optional extra: pip install 'jaxkv[hf]'"
LOCAL_LAYOUTS = (
    "{config}/{split}-*.parquet",
    "{config}/{split}/*.parquet",
    "{config}.jsonl",
    "data/{config}.jsonl",
)
"""Where a local folder holds a config's split (``glob`` patterns), in the order tried."""
_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json"}


# ----------------------------------------------------------------------------------------------
# Rows


def load_rows(source: PathLike, *, config: str, split: str) -> datasets.Dataset:
    """The rows of a config's split, as a ``datasets.Dataset``.

    Args:
        source: a local file (the split itself), a local folder (searched with
            ``LOCAL_LAYOUTS``) or a hub name (``datasets.load_dataset(source, config)``).
        config: the hub config (``"main"``, a BBH task, a LongBench dataset, ...).
        split: the split (``"test"``, ``"train"``, ...).

    Raises:
        ImportError: ``datasets`` is not installed (``MISSING_EXTRA``).
        FileNotFoundError: a folder without the split, or a name that is neither a local path
            nor a dataset ``datasets`` can load (offline: not in the cache).
        ValueError: an unknown file type, or a split without rows.
    """
    datasets = _import_datasets()
    path = Path(source)
    if path.exists():
        files = [path] if path.is_file() else _local_files(path, config=config, split=split)
        builder = _builder(files[0])
        data_files = {split: [str(f) for f in files]}
        rows = datasets.load_dataset(builder, data_files=data_files, split=split)
    else:
        try:
            rows = datasets.load_dataset(str(source), config, split=split)
        except (ConnectionError, FileNotFoundError) as err:
            raise FileNotFoundError(
                f"{source!r} is not a local path, and datasets could not load it (offline, a hub "
                f"dataset must already be in the Hugging Face cache): {err}"
            ) from err
    if len(rows) == 0:
        raise ValueError(f"{_where(source, config, split)}: no rows")
    return rows


def _import_datasets() -> types.ModuleType:
    try:
        import datasets
    except ImportError as err:
        raise ImportError(MISSING_EXTRA) from err
    return datasets


def _local_files(folder: Path, *, config: str, split: str) -> list[Path]:
    patterns = [p.format(config=config, split=split) for p in LOCAL_LAYOUTS]
    for pattern in patterns:
        files = sorted(folder.glob(pattern))
        if files:
            return files
    raise FileNotFoundError(
        f"no {config!r} {split!r} files in {folder}; looked for {', '.join(patterns)}"
    )


def _builder(path: Path) -> str:
    builder = _BUILDERS.get(path.suffix)
    if builder is None:
        raise ValueError(f"{path}: unknown file type; expected one of {sorted(_BUILDERS)}")
    return builder


def _where(source: PathLike, config: str, split: str) -> str:
    return f"{source} [{config}/{split}]"


def _require_columns(rows: datasets.Dataset, columns: tuple[str, ...], *, where: str) -> None:
    missing = [c for c in columns if c not in rows.column_names]
    if missing:
        raise ValueError(f"{where}: missing column(s) {missing}; has {rows.column_names}")


def _head(rows: datasets.Dataset, limit: int | None) -> Iterator[dict]:
    """The first ``limit`` rows (all for None), iterated lazily."""
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    return itertools.islice(rows, limit)


# ----------------------------------------------------------------------------------------------
# Tasks


def gsm8k_examples(
    source: PathLike = GSM8K_HUB,
    split: str = "test",
    *,
    n_shot: int = 8,
    limit: int | None = None,
    data_dir: PathLike | None = None,
) -> list[tasks.Example]:
    """GSM8K chain-of-thought examples from the public set, as ``tasks.gsm8k_examples``.

    Args:
        source: a local file or folder in the hub's layout, or the hub name.
        split: ``"test"`` (1,319) or ``"train"`` (7,473).
        n_shot: exemplars to prepend (from the shipped data).
        limit: keep only the first ``limit`` examples.
        data_dir: the shared data folder, for the exemplars.

    Raises:
        ImportError, FileNotFoundError: as ``load_rows``.
        ValueError: unknown split, bad ``n_shot``, a missing column or an answer without ``####``.
    """
    if split not in ("test", "train"):
        raise ValueError(f"unknown GSM8K split {split!r}; valid: 'test', 'train'")
    prefix = tasks.gsm8k_fewshot_prefix(n_shot=n_shot, data_dir=data_dir)
    rows = load_rows(source, config=GSM8K_CONFIG, split=split)
    _require_columns(rows, ("question", "answer"), where=_where(source, GSM8K_CONFIG, split))
    return [
        tasks.gsm8k_example(row, prefix=prefix, split=split, index=i)
        for i, row in enumerate(_head(rows, limit))
    ]


def bbh_examples(
    task: str,
    source: PathLike = BBH_HUB,
    *,
    limit: int | None = None,
    data_dir: PathLike | None = None,
) -> list[tasks.Example]:
    """BIG-Bench Hard examples from the public set, as ``tasks.bbh_examples``.

    Args:
        task: a BBH task name (the hub config), e.g. ``"date_understanding"``.
        source: a local file or folder in the hub's layout, or the hub name.
        limit: keep only the first ``limit`` examples.
        data_dir: the shared data folder, for the task list and its 3-shot prompt.

    Raises:
        ImportError, FileNotFoundError: as ``load_rows``.
        ValueError: unknown task (the message lists the valid ones) or a missing column.
    """
    valid = tasks.bbh_tasks(data_dir=data_dir)
    if task not in valid:
        raise ValueError(f"unknown BBH task {task!r}; valid tasks: {', '.join(valid)}")
    prefix = tasks.bbh_fewshot_prefix(task, data_dir=data_dir)
    rows = load_rows(source, config=task, split="test")
    _require_columns(rows, ("input", "target"), where=_where(source, task, "test"))
    return [
        tasks.bbh_example(row, prefix=prefix, task=task, index=i)
        for i, row in enumerate(_head(rows, limit))
    ]


def longbench_examples(
    dataset: str,
    source: PathLike = LONGBENCH_HUB,
    *,
    split: str = "test",
    limit: int | None = None,
    config_dir: PathLike | None = None,
) -> list[tasks.Example]:
    """LongBench examples from the public set, as ``tasks.longbench_examples``.

    Row ``i`` (0-based) plays the part of line ``i + 1`` of a JSONL file: in ``meta["line"]``,
    in errors, and in the id of a row without ``_id``.

    Args:
        dataset: the hub config, e.g. ``"hotpotqa"``, or ``"hotpotqa_e"`` for LongBench-E (same
            template as ``hotpotqa``).
        source: a local file or folder (LongBench's ``data.zip`` unzipped, or parquet in the
            hub's layout), or a hub name.
        split: the split.
        limit: keep only the first ``limit`` examples.
        config_dir: the folder with the three config JSON files (default: the shipped ones).

    Raises:
        ImportError, FileNotFoundError: as ``load_rows``.
        ValueError: unknown or unsupported (Chinese) dataset, or a row without a required field
            or with one of the wrong type (naming the source and the row).
    """
    config = tasks.load_longbench_config(config_dir)
    name = tasks.longbench_dataset_name(dataset)
    tasks.check_longbench_dataset(name, config)
    rows = load_rows(source, config=dataset, split=split)
    where = _where(source, dataset, split)
    return [
        tasks.longbench_example(row, config=config, dataset=name, path=where, lineno=i + 1)
        for i, row in enumerate(_head(rows, limit))
    ]


def wikitext_text(
    source: PathLike = WIKITEXT_HUB, split: str = "test", *, config: str = WIKITEXT_CONFIG
) -> str:
    """WikiText as one text, one row per line, for ``tasks.text_windows``.

    The raw configs hold the original files line by line, blank lines as empty rows, so the
    text is the original file up to the whitespace of its blank lines. The test split is held
    out already: cut windows from all of it (``heldout_fraction=1.0``).

    Args:
        source: a local file or folder in the hub's layout, or the hub name.
        split: ``"test"``, ``"validation"`` or ``"train"``.
        config: ``"wikitext-103-raw-v1"`` or ``"wikitext-2-raw-v1"``.

    Raises:
        ImportError, FileNotFoundError: as ``load_rows``.
        ValueError: no ``text`` column, or only blank text.
    """
    rows = load_rows(source, config=config, split=split)
    where = _where(source, config, split)
    _require_columns(rows, ("text",), where=where)
    text = "".join(line.rstrip("\n") + "\n" for line in rows["text"])
    if not text.strip():
        raise ValueError(f"{where}: the text is empty")
    return text
