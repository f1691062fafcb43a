"""Checkpoints: bit-exact round trips, checksums, atomic writes, resumes from intact states."""

import hashlib
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from jaxkv import checkpoint as checkpoint_lib
from jaxkv.checkpoint import CheckpointError, TrainCheckpoints, restore, save
from jaxkv.cli import train as train_cli
from jaxkv.kvlearn.core.checkpoint import load_prp, save_prp
from jaxkv.kvlearn.core.prp import PRPConfig, init_prp
from jaxkv.policies import get_policy
from jaxkv.policies.learned import init_mlp, load_policy, save_policy, shipped_checkpoints
from jaxkv.rl import loop
from jaxkv.rl.config import TrainConfig
from jaxkv.rl.loop import run

REPO = Path(__file__).resolve().parents[1]
TINY = dict(
    model="tiny",
    prompt_len=16,
    decode_steps=8,
    min_budget=4,
    warmup_steps=0,
    steps=4,
    checkpoint_every=2,
)
# sha256 over "keypath=sha256(dtype, shape, bytes)" lines of the shipped checkpoints as the
# loaders before checksums (orbax without verification) read them.
SHIPPED_POLICY_DIGEST = "8fbc63f0fd51c02acf1c47dd39b25d0a08af0b2b7cc4cebba27295aec5d12629"
SHIPPED_PRP_DIGEST = "a231e6750bfd8f3684e299ec956e73a247ecd6d880131fedbee32ba7b9adcc3c"


def tree():
    return {
        "w": jax.random.normal(jax.random.key(0), (3, 5)),
        "half": jnp.arange(6, dtype=jnp.bfloat16).reshape(2, 3) / 7,
        "nested": [jnp.arange(4, dtype=jnp.int32), (jnp.float32(2.5), np.uint8(7))],
    }


def abstract():
    return jax.eval_shape(tree)


def tree_digest(t) -> str:
    lines = []
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(t)[0]:
        a = np.asarray(leaf)
        h = hashlib.sha256(f"{a.dtype.str}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
        lines.append(f"{jax.tree_util.keystr(keypath)}={h.hexdigest()}\n")
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def largest_array_file(path: Path) -> Path:
    files = [f for f in (path / "params").rglob("*") if f.is_file() and "/d/" in f.as_posix()]
    return max(files, key=lambda f: f.stat().st_size)


def assert_one_line_naming(err: pytest.ExceptionInfo, *parts) -> None:
    message = str(err.value)
    assert "\n" not in message and len(message) < 600, message
    for part in parts:
        assert str(part) in message, message


def test_round_trip_is_bit_exact_and_keeps_meta(tmp_path):
    meta = {"note": "x", "n": np.int64(3), "nested": {"a": [1.5, None]}}
    assert save(tmp_path / "c", tree(), meta) == tmp_path / "c"
    back, meta_back = restore(tmp_path / "c", abstract())
    assert jax.tree.structure(back) == jax.tree.structure(abstract())
    for a, b in zip(jax.tree.leaves(tree()), jax.tree.leaves(back), strict=True):
        assert np.asarray(a).dtype == np.asarray(b).dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert meta_back == {"note": "x", "n": 3, "nested": {"a": [1.5, None]}}
    assert checkpoint_lib.read_meta(tmp_path / "c") == meta_back


def test_a_flipped_byte_in_an_array_file_is_named(tmp_path):
    save(tmp_path / "c", tree(), {})
    file = largest_array_file(tmp_path / "c")
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x10
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum mismatch") as err:
        restore(tmp_path / "c", abstract())
    assert_one_line_naming(err, tmp_path / "c", file.relative_to(tmp_path / "c").as_posix())


def test_truncated_or_missing_files_are_one_line_errors(tmp_path):
    save(tmp_path / "c", tree(), {})
    file = largest_array_file(tmp_path / "c")
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="checksum mismatch") as err:
        restore(tmp_path / "c", abstract())
    assert_one_line_naming(err, tmp_path / "c", file.name)
    file.unlink()
    with pytest.raises(CheckpointError, match="missing file") as err:
        restore(tmp_path / "c", abstract())
    assert_one_line_naming(err, file.name)
    (tmp_path / "c" / "meta.json").unlink()
    with pytest.raises(CheckpointError, match="missing meta.json") as err:
        restore(tmp_path / "c", abstract())
    assert_one_line_naming(err, tmp_path / "c")
    with pytest.raises(CheckpointError, match="no such directory"):
        restore(tmp_path / "nothing", abstract())


def test_damaged_or_foreign_meta_is_refused(tmp_path):
    save(tmp_path / "c", tree(), {"lr": 0.125})
    meta_file = tmp_path / "c" / "meta.json"
    text = meta_file.read_text()
    meta_file.write_text(text.replace("0.125", "0.126"))
    with pytest.raises(CheckpointError, match="checksum mismatch in meta.json"):
        restore(tmp_path / "c", abstract())
    meta_file.write_text(text[: len(text) // 2])
    with pytest.raises(CheckpointError, match="unreadable meta.json") as err:
        restore(tmp_path / "c", abstract())
    assert_one_line_naming(err, tmp_path / "c")
    meta_file.write_text('{"lr": 0.125}')  # as written before checksums existed
    with pytest.raises(CheckpointError, match="no checksum"):
        restore(tmp_path / "c", abstract())


def test_restoring_into_another_structure_is_a_one_line_error(tmp_path):
    save(tmp_path / "c", tree(), {})
    wrong = {**abstract(), "w": jax.ShapeDtypeStruct((4, 5), jnp.float32)}
    with pytest.raises(CheckpointError) as err:
        restore(tmp_path / "c", wrong)
    assert_one_line_naming(err, tmp_path / "c")


def test_non_finite_values_are_refused_on_save_and_on_load(tmp_path, monkeypatch):
    bad = {**tree(), "w": tree()["w"].at[1, 2].set(jnp.nan)}
    with pytest.raises(CheckpointError, match=r"non-finite values in array \['w'\]"):
        save(tmp_path / "c", bad, {})
    assert not (tmp_path / "c").exists()
    with pytest.raises(CheckpointError, match="non-finite"):
        save_policy(
            tmp_path / "p", jax.tree.map(lambda x: x * jnp.inf, init_mlp(key=jax.random.key(0))), {}
        )
    assert not (tmp_path / "p").exists()
    # A checkpoint whose recorded checksums were computed without the check (a foreign writer).
    digests = checkpoint_lib._leaf_digests
    monkeypatch.setattr(
        checkpoint_lib,
        "_leaf_digests",
        lambda path, t, **kw: digests(path, jax.tree.map(np.nan_to_num, t), **kw),
    )
    save(tmp_path / "c", bad, {})
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match=r"non-finite values in array \['w'\]"):
        restore(tmp_path / "c", abstract())


@pytest.mark.parametrize("crash", [OSError("disk full"), KeyboardInterrupt()])
def test_a_crash_mid_save_leaves_nothing_under_the_final_name(tmp_path, monkeypatch, crash):
    write_tree = checkpoint_lib._write_tree

    def crashing(directory, t):
        write_tree(directory, t)  # the arrays are on disk, the meta is not
        raise crash

    monkeypatch.setattr(checkpoint_lib, "_write_tree", crashing)
    with pytest.raises(type(crash)):
        save(tmp_path / "c", tree(), {})
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    save(tmp_path / "c", tree(), {"version": 1})
    monkeypatch.setattr(checkpoint_lib, "_write_tree", crashing)
    with pytest.raises(type(crash)):
        save(tmp_path / "c", jax.tree.map(lambda x: x + 1, tree()), {"version": 2})
    assert [p.name for p in tmp_path.iterdir()] == ["c"]
    back, meta = restore(tmp_path / "c", abstract())  # the old checkpoint, intact
    assert meta == {"version": 1} and tree_digest(back) == tree_digest(tree())


def test_save_replaces_a_checkpoint_but_no_other_directory(tmp_path):
    save(tmp_path / "c", tree(), {"version": 1})
    save(tmp_path / "c", tree(), {"version": 2})
    assert restore(tmp_path / "c", abstract())[1] == {"version": 2}
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="is not a checkpoint"):
        save(tmp_path / "mine", tree(), {})
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_train_checkpoints_keep_the_newest_and_fall_back_to_an_intact_one(tmp_path):
    ckpts = TrainCheckpoints(tmp_path, keep=2)
    assert ckpts.restore(abstract()) == (None, 0, [])
    for step in (1, 2, 3):
        ckpts.save(step, jax.tree.map(lambda x, s=step: x + s, tree()))
    assert ckpts.steps() == [2, 3]
    file = largest_array_file(ckpts.dir / "3")
    file.write_bytes(file.read_bytes()[:-3])
    state, step, damaged = ckpts.restore(abstract())
    assert step == 2 and tree_digest(state) == tree_digest(jax.tree.map(lambda x: x + 2, tree()))
    assert [e.path.name for e in damaged] == ["3"] and "checksum mismatch" in damaged[0].reason
    (ckpts.dir / "2" / "meta.json").unlink()
    with pytest.raises(CheckpointError, match="no intact checkpoint") as err:
        ckpts.restore(abstract())
    assert_one_line_naming(err, ckpts.dir, "step 3", "step 2")
    ckpts.save(2, tree())  # a resume from an earlier state replaces the damaged ones
    assert ckpts.steps() == [2] and ckpts.restore(abstract())[1] == 2


def test_load_policy_errors_name_the_path_in_one_line(tmp_path):
    for bad in (tmp_path / "missing", tmp_path / "file.txt", tmp_path):
        (tmp_path / "file.txt").write_text("not a policy")
        with pytest.raises(CheckpointError) as err:
            load_policy(bad)
        assert_one_line_naming(err, bad)
    with pytest.raises(ValueError, match="missing policy.json"):
        get_policy(f"learned:{tmp_path}")
    save(tmp_path / "other", tree(), {}, meta_name="policy.json")
    with pytest.raises(CheckpointError, match="does not describe a policy"):
        load_policy(tmp_path / "other")


def test_shipped_policy_restores_bit_identically_to_the_old_loader():
    params, meta = load_policy(shipped_checkpoints() / "distillcache_smollm2_cpu")
    assert tree_digest(params) == SHIPPED_POLICY_DIGEST
    assert meta["n_params"] == 17_921 and meta["steps"] == 300
    # the shipped name resolves from any working directory
    assert get_policy("learned:distillcache_smollm2_cpu").init() is not None


def test_shipped_prp_restores_bit_identically_to_the_old_loader():
    state, cfg, info = load_prp(REPO / "results" / "kvlearn" / "prp_pretrained")
    assert tree_digest(state) == SHIPPED_PRP_DIGEST
    assert cfg.updates_per_round == 8 and "history" in info


def test_prp_round_trip_and_damage(tmp_path):
    cfg = PRPConfig(replay_size=64)
    state = init_prp(cfg, key=jax.random.key(0))
    save_prp(tmp_path / "p", state, cfg=cfg, info={"epochs": np.int32(2)})
    back, cfg_back, info = load_prp(tmp_path / "p")
    assert cfg_back == cfg and info == {"epochs": 2}
    assert tree_digest(back) == tree_digest(state)
    file = largest_array_file(tmp_path / "p")
    file.write_bytes(b"\0" + file.read_bytes()[1:])
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        load_prp(tmp_path / "p")


def test_resume_skips_a_damaged_newest_checkpoint(tmp_path, capsys):
    cfg = TrainConfig(**TINY)
    whole = run(cfg, tmp_path)
    ckpt_dir = tmp_path / "checkpoints"
    assert sorted(os.listdir(ckpt_dir)) == ["2", "4"]
    file = largest_array_file(ckpt_dir / "4")
    data = bytearray(file.read_bytes())
    data[-1] ^= 0x01
    file.write_bytes(bytes(data))
    capsys.readouterr()
    resumed = run(cfg, tmp_path)
    err = capsys.readouterr().err
    assert f"checkpoint step 4 in {ckpt_dir} is damaged (checksum mismatch" in err
    assert "resuming from step 2" in err
    assert tree_digest(resumed.params) == tree_digest(whole.params)
    assert restore(ckpt_dir / "4", jax.eval_shape(lambda: resumed))[1] == {"step": 4}


def test_a_non_finite_loss_stops_the_run_without_saving(tmp_path, monkeypatch, capsys):
    real = loop.train_step

    def nan_at_step_2(lm, state, *args, **kwargs):
        step = int(state.step)
        state, metrics = real(lm, state, *args, **kwargs)
        if step == 2:
            metrics = {**metrics, "loss": jnp.float32(jnp.nan)}
            state = state.replace(params=jax.tree.map(lambda x: x * jnp.nan, state.params))
        return state, metrics

    monkeypatch.setattr(loop, "train_step", nan_at_step_2)
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(TINY))
    workdir = tmp_path / "run"
    assert train_cli.distillcache_main(["--config", str(config), "--workdir", str(workdir)]) == 2
    err = capsys.readouterr().err
    assert "step 2: non-finite loss=nan" in err and "stopped without saving" in err
    assert TrainCheckpoints(workdir).steps() == [2]
    assert not (workdir / "policy").exists()
    assert len((workdir / "metrics.jsonl").read_text().splitlines()) == 2
