"""Training configuration: one frozen dataclass, parsed from YAML in exactly one place."""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from pathlib import Path
from typing import Any

import yaml

from jaxkv.rl.plackett_luce import ESTIMATORS

STREAMS = ("data", "teacher")
DECISIONS = ("shared", "head")
DATASETS = ("mixed", "shakespeare", "gsm8k")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """DistillCache training settings (paper App. D defaults where they apply).

    ``decisions``: ``shared`` trains the paper's policy (``jaxkv.policies.learned``: 5 features,
    one token set for all layers and heads); ``head`` trains a per-(layer, KV head) ranker
    (``jaxkv.policies.ranker``, its default features), one Plackett-Luce decision per row, from
    ``warm_start`` (a ranker checkpoint: a path or a shipped name) or, without one, from a
    fresh ranker of ``hidden`` units.

    ``score_scale`` multiplies the policy's scores where training reads them (the rollouts'
    sampling and the log-probabilities: a temperature of 1 / ``score_scale``); the saved
    policy's scores are not scaled, and no top-B ranking depends on a positive scale. A
    supervised ranker's scores are nearly flat as Plackett-Luce logits
    (``results/rl_head_warmstart``), so RL from one needs a scale well above 1.
    """

    model: str = "smollm2-135m"
    ratio: float = 0.25
    min_budget: int = 32
    prompt_len: int = 96
    decode_steps: int = 32
    rollouts: int = 4
    gamma: float = 0.99
    beta: float = 0.01
    exact_entropy: bool = False
    estimator: str = "exact"
    decisions: str = "shared"
    warm_start: str = ""
    score_scale: float = 1.0
    learning_rate: float = 3e-4
    warmup_steps: int = 500
    steps: int = 10_000
    clip_norm: float = 1.0
    weight_decay: float = 1e-4
    ema_decay: float = 0.9
    hidden: int = 128
    seed: int = 0
    dataset: str = "mixed"
    stream: str = "data"
    checkpoint_every: int = 50
    data_parallel: int = 1

    def __post_init__(self):
        for name, kind in _field_types().items():
            object.__setattr__(self, name, _typed(name, kind, getattr(self, name)))
        checks = {
            "ratio in (0, 1]": 0 < self.ratio <= 1,
            "rollouts >= 2 (RLOO) or 1 (EMA baseline)": self.rollouts >= 1,
            "prompt_len >= 1": self.prompt_len >= 1,
            "decode_steps >= 1": self.decode_steps >= 1,
            "steps >= 1": self.steps >= 1,
            "0 <= warmup_steps < steps": 0 <= self.warmup_steps < self.steps,
            "0 < gamma <= 1": 0 < self.gamma <= 1,
            f"estimator in {ESTIMATORS}": self.estimator in ESTIMATORS,
            f"stream in {STREAMS}": self.stream in STREAMS,
            f"decisions in {DECISIONS}": self.decisions in DECISIONS,
            "warm_start only with decisions: head": not self.warm_start or self.decisions == "head",
            f"dataset in {DATASETS}": self.dataset in DATASETS,
            "checkpoint_every >= 1": self.checkpoint_every >= 1,
            "hidden >= 1": self.hidden >= 1,
            "score_scale > 0": self.score_scale > 0,
            "data_parallel >= 1": self.data_parallel >= 1,
            "rollouts divisible by data_parallel": (
                self.data_parallel < 1 or self.rollouts % self.data_parallel == 0
            ),
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"invalid training config: {'; '.join(bad)}")

    @property
    def stream_len(self) -> int:
        return self.prompt_len + self.decode_steps

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: list[str] = ()) -> TrainConfig:
        """Reads ``path`` and applies ``key=value`` overrides (values parsed as YAML)."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no config file {path}")
        raw = yaml.safe_load(path.read_text()) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: expected a mapping of settings")
        for item in overrides:
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"override {item!r} is not key=value")
            raw[key.strip()] = yaml.safe_load(value)
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, source: str = "config") -> TrainConfig:
        """Settings from a mapping; values are checked against the field types (``_typed``)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"{source}: unknown settings {unknown}; valid: {sorted(known)}")
        return cls(**raw)


@functools.cache
def _field_types() -> dict[str, type]:
    hints = typing.get_type_hints(TrainConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(TrainConfig)}


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _typed(name: str, kind: type, value: Any) -> Any:
    """``value`` as a ``kind`` setting, or a ValueError naming the setting.

    Integers accept only integers (not bools, not 30.5); numbers accept finite integers, floats
    and numeric strings (PyYAML reads ``1e-3`` as a string); bools and strings accept only
    their own type.
    """
    if kind is float:
        number = _finite_float(value)
        if number is not None:
            return number
    elif isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    raise ValueError(
        f"invalid training config: {name} must be {_TYPE_NAMES[kind]}, got {value!r} "
        f"({type(value).__name__})"
    )


def _finite_float(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return None
    try:
        number = float(value)
    except (ValueError, OverflowError):
        return None
    return number if math.isfinite(number) else None
