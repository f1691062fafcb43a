"""scripts/device_decode.py (issue 17, item 5) runs end to end on tiny shapes on a CPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_device_decode_small_runs_on_cpu(tmp_path):
    # JAX warns when a program captures arrays as constants: the weights must be arguments
    # (captured, Mistral-7B's 14.5 GB were embedded in the program and ran the GPU out of memory)
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_CAPTURED_CONSTANTS_WARN_BYTES="10000")
    env.pop("OUT", None)
    cmd = [sys.executable, "scripts/device_decode.py", "--small", "--no-int8", "--batch", "1"]
    cmd += ["--steps", "2", "--runs", "1", "--warmup", "1", "--out", str(tmp_path)]
    proc = subprocess.run(
        [*cmd, "--profile", "compressed_b1"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "captured during lowering" not in proc.stderr, proc.stderr[-3000:]
    report = json.loads((tmp_path / "device_decode.json").read_text())
    assert set(report["rows"]) == {"full_b1", "compressed_b1"}
    for row in report["rows"].values():
        assert row["ms_per_step"] > 0 and row["tokens_per_s"] > 0
    comp, full = report["rows"]["compressed_b1"], report["rows"]["full_b1"]
    assert comp["capacity"] < full["capacity"]
    assert report["speedups"]["compressed_vs_full"] > 0
    assert "| compressed_b1 |" in (tmp_path / "device_decode.md").read_text()
    # the profile of the traced variant: a table of ops with their time, and its HLO beside it
    profile = (tmp_path / "device_profile.md").read_text()
    assert "## compressed_b1" in profile and "XLA CPU thunks" in profile
    rows = [ln for ln in profile.splitlines() if ln.startswith("| `")]
    assert rows and all(float(r.split("|")[3]) >= 0 for r in rows)
    assert not any(r.startswith(("| `while", "| `ThunkExecutor")) for r in rows)
    assert "ENTRY" in (tmp_path / "hlo_compressed_b1.txt").read_text()
    # an unknown variant is refused before anything runs or is written
    bad = subprocess.run(
        [*cmd, "--profile", "compressed_b9"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert bad.returncode != 0 and "no variant ['compressed_b9']" in bad.stderr
