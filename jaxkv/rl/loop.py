"""The DistillCache training loop around ``train_step`` (``python -m jaxkv.train distillcache``).

Resumable: the state is checkpointed every ``checkpoint_every`` steps and on Ctrl-C; running
the same command again restores the newest intact checkpoint (a damaged newer one is reported
and skipped), drops metric lines written after it, and continues. Data and keys derive from
(seed, step), so a resumed run equals an uninterrupted one. A step with a non-finite loss or
gradient stops the run; that state is never saved.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import jax
import numpy as np
import yaml
from jax.sharding import NamedSharding, PartitionSpec
from tqdm import tqdm

from jaxkv import sharding
from jaxkv.checkpoint import TrainCheckpoints
from jaxkv.config import ModelConfig
from jaxkv.generate import generate_tokens
from jaxkv.model.loading import load_model
from jaxkv.model.params import init_params
from jaxkv.policies import ranker as ranker_lib
from jaxkv.policies.learned import checkpoint_path, count, init_mlp, save_policy
from jaxkv.rl.config import TrainConfig
from jaxkv.rl.data import build_corpora, stream_for_step
from jaxkv.rl.step import TrainState, init_state, train_step

METRICS = "metrics.jsonl"
CONFIG = "config.yaml"


class TrainingDiverged(ValueError):
    """A step gave a non-finite loss or gradient (the run stops; that state is not saved)."""


def load_lm(name: str):
    """(config, params, tokenizer); ``tiny`` is a random toy model with byte tokens."""
    if name == "tiny":
        cfg = ModelConfig.tiny()
        return cfg, init_params(cfg, key=jax.random.key(0), scale=0.2), None
    m = load_model(name)
    return m.config, m.params, m.tokenizer


def _keys(cfg: TrainConfig, step: int, mesh):
    keys = jax.random.split(jax.random.fold_in(jax.random.key(cfg.seed), step), cfg.rollouts)
    if mesh is None:
        return keys
    return jax.device_put(keys, NamedSharding(mesh, PartitionSpec("data")))


def _teacher_stream(params, window, cfg: TrainConfig, config):
    """Prompt from the data, continuation from the full-cache model's greedy decoding."""
    prompt = window[: cfg.prompt_len].tolist()
    (cont,) = generate_tokens(params, [prompt], config=config, max_new_tokens=cfg.decode_steps)
    cont = (cont + [0] * cfg.decode_steps)[: cfg.decode_steps]
    return np.asarray(prompt + cont, np.int32)


def _check_workdir(workdir: Path, cfg: TrainConfig, *, started: bool) -> None:
    """Refuses a workdir holding a started run (one with checkpoints) of another config."""
    if workdir.exists() and not workdir.is_dir():
        raise ValueError(f"--workdir {workdir} exists and is not a directory")
    saved = workdir / CONFIG
    # as settings, not text: a run saved before a setting existed has its default
    if started and saved.exists() and TrainConfig.from_yaml(saved) != cfg:
        raise ValueError(
            f"{workdir} holds a run with a different config ({saved}); resume with the same "
            "settings or choose a new --workdir"
        )


def _config_text(cfg: TrainConfig) -> str:
    return yaml.safe_dump(cfg.__dict__, sort_keys=True)


def _truncate_metrics(path: Path, last_step: int) -> None:
    """Keeps the metric lines of steps < last_step (a resume rewrites the rest)."""
    if not path.exists():
        return
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    kept = [ln for ln in lines if json.loads(ln)["step"] < last_step]
    path.write_text("".join(ln + "\n" for ln in kept))


def init_policy(cfg: TrainConfig) -> dict:
    """The policy's starting parameters: a fresh shared MLP (``decisions: shared``), or for
    ``head`` the ranker checkpoint ``warm_start`` (over the ranker's default features, not
    residual) or a fresh ranker.

    Raises:
        jaxkv.checkpoint.CheckpointError: ``warm_start`` is no readable ranker checkpoint.
        ValueError: it is a ranker over other features, or a residual one.
    """
    key = jax.random.key(cfg.seed)
    if cfg.decisions == "shared":
        return init_mlp(key=key, hidden=cfg.hidden)
    if not cfg.warm_start:
        return ranker_lib.init_params(key=key, hidden=cfg.hidden)
    params, meta = ranker_lib.load_ranker_params(checkpoint_path(cfg.warm_start))
    if tuple(meta["features"]) != ranker_lib.DEFAULT_FEATURES or "base" in params:
        raise ValueError(
            f"warm_start {cfg.warm_start}: per-head training starts from a ranker over "
            f"{list(ranker_lib.DEFAULT_FEATURES)} without a base feature; this one reads "
            f"{meta['features']}" + (f" with base {meta.get('base')}" if "base" in params else "")
        )
    return params


def run(cfg: TrainConfig, workdir: Path, *, stop_after: int | None = None) -> TrainState:
    """Trains (or resumes) in ``workdir``; returns the final state.

    Raises:
        ValueError: bad arguments, a workdir of another run, no intact checkpoint to resume
            from, or a non-finite loss or gradient (``TrainingDiverged``).
    """
    if stop_after is not None and stop_after < 1:
        raise ValueError(f"--stop-after must be a positive number of total steps, got {stop_after}")
    workdir = Path(workdir)
    ckpts = TrainCheckpoints(workdir)
    _check_workdir(workdir, cfg, started=bool(ckpts.steps()))
    policy_params = init_policy(cfg)  # a bad warm_start fails before the model loads
    config, params, tokenizer = load_lm(cfg.model)
    corpora = build_corpora(tokenizer, dataset=cfg.dataset)
    mesh = sharding.make_mesh(data=cfg.data_parallel) if cfg.data_parallel > 1 else None
    state = init_state(cfg, policy_params)
    state, saved = _resume(ckpts, state)
    start = int(state.step)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / CONFIG).write_text(_config_text(cfg))  # only now: every argument is valid
    _truncate_metrics(workdir / METRICS, start)
    end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    if end <= start < cfg.steps:
        print(
            f"at step {start} already (--stop-after {stop_after}): nothing to do", file=sys.stderr
        )
    bar = tqdm(
        range(start, end), initial=start, total=cfg.steps, desc="distillcache", mininterval=2.0
    )
    try:
        with (workdir / METRICS).open("a") as log:
            for step in bar:
                window = stream_for_step(corpora, step=step, seed=cfg.seed, length=cfg.stream_len)
                if cfg.stream == "teacher":
                    window = _teacher_stream(params, window, cfg, config)
                t0 = time.perf_counter()
                state, metrics = train_step(
                    params, state, window, _keys(cfg, step, mesh), cfg=cfg, config=config
                )
                row = {
                    "step": step,
                    **{k: float(v) for k, v in metrics.items()},
                    "seconds": time.perf_counter() - t0,
                }
                _check_finite(row, saved=saved, ckpt_dir=ckpts.dir)
                log.write(json.dumps(row) + "\n")
                log.flush()
                bar.set_postfix(
                    reward=f"{row['reward']:.3f}",
                    kl=f"{row['kl']:.3f}",
                    entropy=f"{row['entropy']:.2f}",
                )
                if (step + 1) % cfg.checkpoint_every == 0:
                    ckpts.save(step + 1, state)
                    saved = step + 1
    except KeyboardInterrupt:
        print(f"\ninterrupted: saving step {int(state.step)}", file=sys.stderr)
        ckpts.save(int(state.step), state)
        raise
    if int(state.step) != saved:
        ckpts.save(int(state.step), state)
    if int(state.step) == cfg.steps:
        _finish(workdir, cfg, state)
    return state


def _resume(ckpts: TrainCheckpoints, state: TrainState) -> tuple[TrainState, int | None]:
    """(the newest intact checkpointed state or ``state``, its step or None); reports damage."""
    restored, step, damaged = ckpts.restore(jax.eval_shape(lambda: state))
    for e in damaged:
        print(
            f"checkpoint step {e.path.name} in {ckpts.dir} is damaged ({e.reason}); "
            f"resuming from step {step}",
            file=sys.stderr,
        )
    return (state, None) if restored is None else (restored, step)


def _check_finite(row: dict[str, float], *, saved: int | None, ckpt_dir: Path) -> None:
    """Raises ``TrainingDiverged`` if any metric (loss, grad_norm, ...) is NaN or inf."""
    bad = {k: v for k, v in row.items() if not math.isfinite(v)}
    if bad:
        last = f"step {saved} in {ckpt_dir}" if saved is not None else "none"
        raise TrainingDiverged(
            f"step {row['step']}: non-finite "
            + ", ".join(f"{k}={v}" for k, v in bad.items())
            + f"; stopped without saving this state (latest checkpoint: {last})"
        )


def _finish(workdir: Path, cfg: TrainConfig, state: TrainState) -> None:
    meta = {
        "train_config": cfg.__dict__,
        "steps": int(state.step),
        "command": " ".join(["python -m jaxkv.train"] + sys.argv[1:]),
    }
    if cfg.decisions == "shared":
        path = save_policy(workdir / "policy", state.params, meta)
    else:  # a per-head ranker: ranker:<workdir>/policy
        path = ranker_lib.save_ranker(workdir / "policy", state.params, meta)
    plot_metrics(workdir / METRICS, workdir / "training.png")
    print(f"policy ({count(state.params)} parameters) saved to {path}")


def plot_metrics(metrics_path: Path, out: Path) -> None:
    """Reward, KL and entropy curves (raw and smoothed) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(ln) for ln in metrics_path.read_text().splitlines() if ln.strip()]
    steps = np.array([r["step"] for r in rows])
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.5))
    for ax, key in zip(axes, ("kl", "entropy", "grad_norm"), strict=True):
        y = np.array([r[key] for r in rows])
        ax.plot(steps, y, alpha=0.3, label="per step")
        k = max(1, len(y) // 20)
        ax.plot(steps[k - 1 :], np.convolve(y, np.ones(k) / k, mode="valid"), label=f"mean of {k}")
        ax.set_title(key if key != "kl" else "KL(P_full || P_pruned) per token (= -reward)")
        ax.set_xlabel("step")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
