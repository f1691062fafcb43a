"""Fidelity to the full cache under teacher forcing (paper Fig. 1).

Held-out text is cut into token windows (``tasks.text_windows``). For each window the first
``prompt_len`` tokens are prefilled (and evicted down to the budget), then the rest of the window
is teacher-forced one token at a time (``generate.teacher_forced``, as in generation): with
eviction after every step under the ``decode`` protocol (the paper's), with none under
``prefill`` (compress once, kvpress's). ``granularity`` is the selection's (shared, layer, head,
adaptive, global: ``jaxkv.eviction``); a row named ``<policy>@<granularity>`` selects with its own
(``runner.parse_policies``), and the rows of each granularity share one compiled switch. At
each step the pruned cache's next-token distribution Q is compared with the full cache's P on
the same prefix:

* ``kl_mean``: mean over steps and windows of KL(P || Q) in nats (``metrics.kl_divergence``);
* ``ppl``: perplexity of the continuation tokens under Q; ``ppl_full`` under P;
  ``ppl_increase = ppl - ppl_full`` (absolute, as the paper's "+0.35");
* ``top1_agreement``: share of steps where argmax Q = argmax P.

``kl_std`` / ``ppl_std`` are standard deviations over seeds (the random policy's keys, a learned
policy's checkpoints); a deterministic policy runs once (std 0, ``n_seeds = 1``);
``kl_window_std`` is the spread of the per-window mean KL (the sampling noise of the text).

The full-cache reference is the same teacher-forced loop without compression; with r = 1 the
compressed loop reproduces it bit for bit, so those rows show KL = 0 exactly. The ``full``
policy (which never evicts) is that reference and is reported without a second run.

The ``oracle`` policy (``jaxkv.policies.oracle``) reads the attention the window's future
queries pay under the full cache: a second full-cache pass per batch of windows computes it
(``generate.full_cache_attention``). It is the upper bound to report beside the policies, and
runs outside the switch of the others (its state is that attention, per batch).

``kvzip`` (``jaxkv.policies.kvzip``) is scored the same way from the prompt alone: a
full-cache pass over ``prompt + repeat request + prompt`` gives, per prompt position, the most
attention a reconstruction query pays it. It compresses once, so it needs
``protocol="prefill"``, and it also runs outside the switch; so does a ranker that reads those
scores as features (``jaxkv.policies.ranker.RECON_FEATURES``). Such policies say what they
read in ``Policy.window_input``.

With ``kv_dtype="int8"`` (``--kv-dtype int8``) every stream but the reference runs on an int8
KV cache (``jaxkv.kvcache``): the reference stays the full cache in the model's dtype, the
``full`` row is the int8 full cache (what int8 alone costs), and each policy at r = 1 equals
that row bit for bit.

``evaluate`` is the whole job (``python -m jaxkv.eval fidelity``): the text is a file
(tinyshakespeare by default) or WikiText through ``hub``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np

from jaxkv import kvcache
from jaxkv.evals import hub, metrics, report, runner, tasks
from jaxkv.evals.runner import (
    EvalModel,
    Job,
    PolicyGroup,
    switch_compression,
    switch_policy,
    switch_state,
)
from jaxkv.eviction import POOLED, Compression
from jaxkv.generate import full_cache_attention, teacher_forced
from jaxkv.policies import kvzip as kvzip_lib
from jaxkv.policies import needs_window
from jaxkv.policies import oracle as oracle_lib

NAME = "fidelity"
TITLE = "Fidelity to the full cache (teacher forcing, paper Fig. 1)"
DEFAULT_TEXT = "tinyshakespeare (held-out tail)"
KV_DTYPES = ("model", kvcache.INT8)
COMPRESSION_OPTIONS = ("head_floor", "head_cap", "evict_every")  # FidelitySettings -> Compression


@dataclasses.dataclass(frozen=True)
class FidelitySettings:
    """How the text is cut and run.

    Attributes:
        prompt_len: tokens of each window prefilled before teacher forcing starts.
        batch_size: windows per compiled call (the last batch is padded by repetition).
        min_budget: B_min of every compression.
        protocol: ``decode`` (evict at every step) or ``prefill`` (compress once).
        granularity: ``shared``, ``layer``, ``head``, ``adaptive`` or ``global``.
        kv_dtype: the compared streams' key/value storage, ``model`` (the model's dtype) or
            ``int8`` (an int8 KV cache; the reference always keeps the model's).
        head_floor, head_cap: the pooled granularities' per-head bounds
            (``Compression.head_floor`` / ``head_cap``); None: ``Compression``'s defaults.
        evict_every: decode steps between evictions (``Compression.evict_every``); None: 1.
        kvzip_request: what follows kvzip's repeat prompt (``kvzip.REQUESTS``, ``repeat_ids``).
    """

    prompt_len: int = 256
    batch_size: int = 4
    min_budget: int = 32
    protocol: str = "decode"
    granularity: str = "shared"
    kv_dtype: str = "model"
    head_floor: float | None = None
    head_cap: float | None = None
    evict_every: int | None = None
    kvzip_request: str = kvzip_lib.DEFAULT_REQUEST

    def __post_init__(self):
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {self.kv_dtype!r}")
        kvzip_lib.check_request(self.kvzip_request)

    @property
    def compression_options(self) -> dict:
        """The ``Compression`` settings given (per-head bounds, eviction period), as keyword
        arguments."""
        given = {n: getattr(self, n) for n in COMPRESSION_OPTIONS}
        return {k: v for k, v in given.items() if v is not None}

    def options_for(self, granularity: str) -> dict:
        """``compression_options`` for a row selecting with ``granularity``: the per-head
        bounds only where it pools rows (``adaptive``, ``global``)."""
        options = self.compression_options
        if granularity not in POOLED:
            options.pop("head_floor", None)
            options.pop("head_cap", None)
        return options

    @property
    def cache_dtype(self) -> str | None:
        """``kvcache.init_cache``'s ``dtype``: None for the model's."""
        return None if self.kv_dtype == "model" else self.kv_dtype


def stream_logits(
    model: EvalModel,
    windows_NT: np.ndarray,
    *,
    settings: FidelitySettings,
    compression: Compression | None,
    policy_state=None,
    seed: int = 0,
) -> np.ndarray:
    """Teacher-forced logits [N, T - prompt_len, V] of every window, in fixed-size batches.

    A policy that reads the window (``Policy.window_input``) gets its state from each batch
    (``window_state``; ``policy_state`` is then ignored)."""
    n, b = len(windows_NT), min(settings.batch_size, len(windows_NT))
    from_window = compression is not None and needs_window(compression.policy)
    out = []
    for start in range(0, n, b):
        chunk = windows_NT[start : start + b]
        real = len(chunk)
        if real < b:  # keep one compiled shape: pad with copies of the last window
            chunk = np.concatenate([chunk, np.repeat(chunk[-1:], b - real, axis=0)])
        if from_window:
            policy_state = window_state(
                model, compression.policy, chunk, settings.prompt_len, settings.kvzip_request
            )
        logits, _ = teacher_forced(
            model.params,
            chunk,
            prompt_len=settings.prompt_len,
            config=model.config,
            compression=compression,
            policy_state=policy_state,
            key=jax.random.key(seed),
            kv_dtype=settings.cache_dtype,
        )
        out.append(np.asarray(logits)[:real])
    return np.concatenate(out)


def window_state(
    model: EvalModel,
    policy,
    windows_BT: np.ndarray,
    prompt_len: int,
    request: str = kvzip_lib.DEFAULT_REQUEST,
):
    """The state of a policy that reads the windows themselves (``Policy.window_input``): the
    oracle's future attention, or kvzip's reconstruction scores of the prompts after the
    repeat ``request`` (module docstring), passed to the policy's ``init``."""
    if policy.window_input == "future":
        attn = full_cache_attention(
            model.params, windows_BT, prompt_len=prompt_len, config=model.config
        )
        given = oracle_lib.future_attention(attn, first_query=prompt_len)
    else:
        prompts = windows_BT[:, :prompt_len]
        given = prompt_reconstruction(
            model.params, prompts, repeat_ids(model.tokenizer, request), config=model.config
        )
    return policy.init(**{policy.window_input: given})


def prompt_reconstruction(
    params: dict, prompts_BS: np.ndarray, repeat_R: np.ndarray, *, config
) -> kvzip_lib.Reconstruction:
    """kvzip's reconstruction scores of prompts [B, S]: one full-cache pass over
    ``prompt + repeat request + prompt`` (``repeat_ids``)."""
    S = prompts_BS.shape[1]
    repeat = np.tile(repeat_R, (len(prompts_BS), 1))
    tokens = np.concatenate([prompts_BS, repeat, prompts_BS, prompts_BS[:, -1:]], axis=1)
    attn = full_cache_attention(params, tokens, prompt_len=S, config=config)  # last: a query
    return kvzip_lib.reconstruction(attn, S)


def repeat_ids(tokenizer, request: str = kvzip_lib.DEFAULT_REQUEST) -> np.ndarray:
    """kvzip's repeat request: ``kvzip.REPEAT_PROMPT``, then (``request``, ``kvzip.REQUESTS``)
    a newline (``plain``: kvpress's suffix without a chat template) or what the chat template
    puts between a user's message and the assistant's answer (``chat``: kvpress's suffix with
    one; a newline when the tokenizer has none), without special tokens added around them."""
    kvzip_lib.check_request(request)
    suffix = "\n"
    if request == "chat" and getattr(tokenizer, "chat_template", None):
        dummy, sep = "dummy context", "\n" + "#" * len("dummy context")
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": dummy + sep}], tokenize=False, add_generation_prompt=True
        )
        suffix = text.split(sep)[1]
    return np.asarray(
        [i for t in (kvzip_lib.REPEAT_PROMPT, suffix) for i in _plain_ids(tokenizer, t)],
        np.int32,
    )


def _plain_ids(tokenizer, text: str) -> list[int]:
    if isinstance(tokenizer, runner.ByteTokenizer):
        return tokenizer.encode(text)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _scores(ref_NSV: np.ndarray, logits_NSV: np.ndarray, targets_NS: np.ndarray) -> dict:
    """Per-window KL, NLL and top-1 agreement of one pruned stream against the reference."""
    kl = np.stack([metrics.kl_divergence(r, q) for r, q in zip(ref_NSV, logits_NSV, strict=True)])
    nll = np.stack([metrics.token_nll(q, t) for q, t in zip(logits_NSV, targets_NS, strict=True)])
    agree = np.argmax(ref_NSV, -1) == np.argmax(logits_NSV, -1)
    return {
        "kl_mean": float(kl.mean()),
        "kl_max": float(kl.max()),
        "kl_per_window": [float(x) for x in kl.mean(axis=1)],
        "nll_mean": float(nll.mean()),
        "ppl": metrics.perplexity(nll),
        "top1_agreement": float(agree.mean()),
    }


def run(
    model: EvalModel,
    groups: Sequence[PolicyGroup],
    *,
    ratios: Sequence[float],
    seeds: Sequence[int],
    windows_NT: np.ndarray,
    settings: FidelitySettings,
    store: report.ResultStore,
) -> list[dict]:
    """Evaluates every policy group × ratio (× seed) and records each cell in ``store``.

    Returns:
        The summarized rows (``summarize``).
    """
    windows_NT = np.asarray(windows_NT, np.int32)
    if not 0 < settings.prompt_len < windows_NT.shape[1]:
        raise ValueError(
            f"prompt_len must be in [1, {windows_NT.shape[1] - 1}] for windows of "
            f"{windows_NT.shape[1]} tokens, got {settings.prompt_len}"
        )
    targets = windows_NT[:, settings.prompt_len :]
    switched = {}  # granularity -> the members that run behind one switch policy with it
    for g in groups:
        if not g.is_full:
            gran = g.selection(settings.granularity)
            switched.setdefault(gran, []).extend(p for p in g.members if not needs_window(p))
    n_cells = len(ratios) * sum(1 if g.is_full else len(g.runs(seeds)) for g in groups)
    exact = dataclasses.replace(settings, kv_dtype="model")
    with report.progress(n_cells + 1, desc=NAME) as bar:
        ref = stream_logits(model, windows_NT, settings=exact, compression=None)
        nll_ref = np.stack([metrics.token_nll(r, t) for r, t in zip(ref, targets, strict=True)])
        ppl_full = metrics.perplexity(nll_ref)
        full_cell = _full_cell(model, windows_NT, ref, targets, settings, groups)
        bar.update()
        for ratio in ratios:
            comps = {
                gran: switch_compression(
                    switch_policy(members, granularity=gran),
                    ratio=ratio,
                    min_budget=settings.min_budget,
                    protocol=settings.protocol,
                    granularity=gran,
                    **settings.options_for(gran),
                )
                for gran, members in switched.items()
                if members
            }
            for group in groups:
                gran = group.selection(settings.granularity)
                for member, seed in [(None, seeds[0])] if group.is_full else group.runs(seeds):
                    if member is None:
                        cell = full_cell
                    else:
                        if needs_window(member):
                            member_comp, state = _alone(member, ratio, settings, gran), None
                        else:
                            member_comp = comps[gran]
                            state = switch_state(switched[gran], switched[gran].index(member))
                        logits = stream_logits(
                            model,
                            windows_NT,
                            settings=settings,
                            compression=member_comp,
                            policy_state=state,
                            seed=seed,
                        )
                        cell = _scores(ref, logits, targets)
                    store.add(
                        {
                            "policy": group.label,
                            "member": group.label if member is None else member.name,
                            "ratio": ratio,
                            "seed": seed,
                            "ppl_full": ppl_full,
                            **cell,
                        }
                    )
                    bar.update()
    return store.results()


def _full_cell(model, windows_NT, ref, targets, settings: FidelitySettings, groups) -> dict:
    """The ``full`` row: the reference itself, or (when ``settings.kv_dtype`` is not the
    model's and some group is ``full``) the full cache in that dtype against it."""
    if settings.cache_dtype is None or not any(g.is_full for g in groups):
        return _scores(ref, ref, targets)
    logits = stream_logits(model, windows_NT, settings=settings, compression=None)
    return _scores(ref, logits, targets)


def _alone(policy, ratio: float, settings: FidelitySettings, granularity: str) -> Compression:
    """The Compression of one policy run outside the switch (one that reads the window)."""
    return Compression(
        policy=policy,
        ratio=ratio,
        min_budget=settings.min_budget,
        granularity=granularity,
        protocol=settings.protocol,
        **settings.options_for(granularity),
    )


def summarize(records: list[dict]) -> list[dict]:
    """Records -> one row per (policy, ratio): means and stds over seeds."""
    rows = []
    for (policy, ratio), runs in report.group_by(records, ("policy", "ratio")).items():
        kl_mean, kl_std = metrics.mean_std([r["kl_mean"] for r in runs])
        ppl, ppl_std = metrics.mean_std([r["ppl"] for r in runs])
        ppl_full = runs[0]["ppl_full"]
        windows = np.mean([r["kl_per_window"] for r in runs], axis=0)
        rows.append(
            {
                "policy": policy,
                "ratio": ratio,
                "kl_mean": kl_mean,
                "kl_std": kl_std,
                "ppl": ppl,
                "ppl_full": ppl_full,
                "ppl_increase": ppl - ppl_full,
                "ppl_std": ppl_std,
                "top1_agreement": float(np.mean([r["top1_agreement"] for r in runs])),
                "kl_window_std": float(np.std(windows, ddof=1)) if windows.size > 1 else 0.0,
                "n_seeds": len(runs),
            }
        )
    return rows


def render(rows: list[dict]) -> str:
    """Markdown: KL and perplexity increase, policy × ratio."""

    def table(cell):
        return report.pivot(
            rows, row_key="policy", col_key="ratio", cell=cell, col_label=lambda r: f"r={r:g}"
        )

    kl = table(lambda r: report.fmt_pm(r["kl_mean"], r["kl_std"], 4, n=r["n_seeds"]))
    dppl = table(lambda r: report.fmt_pm(r["ppl_increase"], r["ppl_std"], 3, n=r["n_seeds"]))
    agree = table(lambda r: f"{100 * r['top1_agreement']:.1f}")
    ppl_full = rows[0]["ppl_full"]
    return (
        "## Mean per-step KL(P_full || P_pruned) (nats; lower is better)\n\n"
        f"{kl}\n## Perplexity increase over the full cache (full-cache ppl {ppl_full:.3f})\n\n"
        f"{dppl}\n## Top-1 agreement with the full cache (%)\n\n{agree}"
    )


def plot(rows: list[dict], out_dir: Path) -> list[Path]:
    """Fig. 1: perplexity increase vs ratio, and KL vs ratio."""
    paths = []
    for key, std, ylabel, logy, suffix in (
        ("ppl_increase", "ppl_std", "perplexity increase over full cache", True, "ppl"),
        ("kl_mean", "kl_std", "mean per-step KL(P_full || P_pruned) [nats]", True, "kl"),
    ):
        series = {}
        for (policy,), rs in report.group_by(rows, ("policy",)).items():
            rs = sorted(rs, key=lambda r: r["ratio"])
            series[policy] = (
                [r["ratio"] for r in rs],
                [r[key] for r in rs],
                [r[std] for r in rs] if any(r["n_seeds"] > 1 for r in rs) else None,
            )
        paths.append(
            report.line_plot(
                series,
                out_dir / f"{NAME}_{suffix}.png",
                xlabel="KV-cache budget ratio r",
                ylabel=ylabel,
                title=f"Fidelity vs budget ({ylabel.split(' [')[0]})",
                logy=logy,
                logx=True,
            )
        )
    return paths


# ----------------------------------------------------------------------------------------------
# The job


def _non_default_selection(settings: FidelitySettings) -> dict:
    """The protocol and granularity for the result file's config, each only when it is not
    the default (so that default runs keep their earlier files byte for byte)."""
    default = FidelitySettings()
    return {
        name: getattr(settings, name)
        for name in ("protocol", "granularity", "kv_dtype", *COMPRESSION_OPTIONS)
        if getattr(settings, name) != getattr(default, name)
    }


def _reads_reconstruction(job: Job) -> bool:
    """Some policy of ``job`` reads kvzip's reconstruction pass (``Policy.window_input``)."""
    return any(p.window_input == "reconstruction" for g in job.groups for p in g.members)


def check_selection(job: Job, settings: FidelitySettings | None = None) -> None:
    """Every evicting policy of ``job`` supports its row's granularity and the protocol, and
    the ``Compression`` options of ``settings`` (None: none) are valid (raises the
    ``Compression`` error naming the policy, before the model loads)."""
    settings = settings or FidelitySettings()
    for group in job.groups:
        gran = group.selection(job.granularity)
        for policy in group.members:
            if policy.evicts:
                Compression(
                    policy=policy,
                    ratio=1.0,
                    granularity=gran,
                    protocol=job.protocol,
                    **settings.options_for(gran),
                )


def pooling_options(
    job: Job, *, head_floor: float | None = None, head_cap: float | None = None
) -> dict:
    """The per-head bounds given (None: not given) as ``Compression`` keyword arguments;
    raises unless a row of ``job`` pools rows (``adaptive``, ``global``), which alone read
    them."""
    pooling = {"head_floor": head_floor, "head_cap": head_cap}
    pooling = {k: v for k, v in pooling.items() if v is not None}
    pooled = {g.selection(job.granularity) for g in job.groups if not g.is_full} & set(POOLED)
    if pooling and not pooled and job.granularity not in POOLED:
        names = "/".join("--" + k.replace("_", "-") for k in pooling)
        raise ValueError(
            f"{names}: only with --granularity adaptive or global (or a row's @adaptive/@global)"
        )
    return pooling


def check_prompt_len(*, window: int, prompt_len: int) -> None:
    """``prompt_len`` must leave at least one token of the ``window`` to teacher-force."""
    if not 0 < prompt_len < window:
        raise ValueError(
            f"--prompt-len must be in [1, {window - 1}] (less than --window {window}), "
            f"got {prompt_len}"
        )


def evaluate(
    job: Job,
    *,
    window: int,
    prompt_len: int,
    text: str | None = None,
    heldout: float | None = None,
    offset: int = 0,
    wikitext: str | None = None,
    wikitext_config: str = hub.WIKITEXT_CONFIG,
    wikitext_split: str = "test",
    kv_dtype: str = "model",
    head_floor: float | None = None,
    head_cap: float | None = None,
    evict_every: int | None = None,
    kvzip_request: str = kvzip_lib.DEFAULT_REQUEST,
) -> report.ResultStore:
    """Cuts the text into ``job.limit`` windows and runs ``run``; returns the finished store.

    Args:
        job: the shared settings.
        window: tokens per window.
        prompt_len: prefilled tokens per window.
        text: a text file (None: tinyshakespeare), unless ``wikitext``.
        heldout: the tail fraction of the text used (None: 1 for WikiText, whose test split is
            held out already, else ``tasks.HELDOUT_FRACTION``).
        offset: tokens of the held-out part skipped before the first window (windows of
            one held-out part that an earlier run did not read).
        wikitext: WikiText's source for ``hub.wikitext_text`` (a hub name or local folder).
        wikitext_config: its config.
        wikitext_split: its split.
        kv_dtype: ``model`` or ``int8`` (``FidelitySettings.kv_dtype``).
        head_floor, head_cap: per-head bounds of ``adaptive`` and ``global`` (None: the
            defaults; an error with any other granularity).
        evict_every: decode steps between evictions (None: 1; the ``decode`` protocol only).
        kvzip_request: what follows kvzip's repeat prompt (``FidelitySettings``); in the
            result file's config when a policy reads kvzip's reconstruction.

    Raises:
        ValueError, FileNotFoundError: ``prompt_len`` not below ``window``, a policy that
            does not support ``job.granularity``, a bad text, or too little of it for the
            windows, before the model loads; windows longer than the model's context.
        ImportError: ``wikitext`` without the ``datasets`` extra.
    """
    check_prompt_len(window=window, prompt_len=prompt_len)
    pooling_options(job, head_floor=head_floor, head_cap=head_cap)
    if evict_every is not None and job.protocol != "decode":
        raise ValueError("--evict-every: only with --protocol decode (prefill evicts once)")
    settings = FidelitySettings(
        prompt_len=prompt_len,
        batch_size=job.batch_size,
        min_budget=job.min_budget,
        protocol=job.protocol,
        granularity=job.granularity,
        kv_dtype=kv_dtype,
        head_floor=head_floor,
        head_cap=head_cap,
        evict_every=evict_every,
        kvzip_request=kvzip_request,
    )
    check_selection(job, settings)
    if text is not None and wikitext is not None:
        raise ValueError("give a text file or WikiText, not both")
    body = None
    if wikitext is not None:
        text = f"{wikitext} [{wikitext_config}/{wikitext_split}]"
        body = hub.wikitext_text(wikitext, wikitext_split, config=wikitext_config)
    if heldout is None:
        heldout = tasks.HELDOUT_FRACTION if body is None else 1.0
    cut = dict(
        window=window, n_windows=job.limit, heldout_fraction=heldout, text=body, offset=offset
    )
    tasks.check_text_windows(text, **cut)
    model = runner.load_eval_model(job.model, dtype=job.dtype, attention=job.attention)
    runner.check_fits(model, window, what="--window")
    windows = tasks.text_windows(text, tokenizer=model.tokenizer, **cut)
    store = report.ResultStore(
        job.out,
        NAME,
        model=model.name,
        config={
            **job.config,
            "text": text or DEFAULT_TEXT,
            "window": window,
            "prompt_len": prompt_len,
            "windows": len(windows),
            "heldout": heldout,
            **({"offset": offset} if offset else {}),  # earlier files stay byte for byte
            **_non_default_selection(settings),
            **({"kvzip_request": kvzip_request} if _reads_reconstruction(job) else {}),
        },
        summarize=summarize,
        render=render,
        plot=plot,
        title=TITLE,
    )
    run(
        model,
        job.groups,
        ratios=job.ratios,
        seeds=job.seeds,
        windows_NT=windows,
        settings=settings,
        store=store,
    )
    store.finish()
    return store
