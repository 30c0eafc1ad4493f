"""CPU: the ``mok`` command checks its input before any process starts -- one line naming the problem on stderr
and exit status 2 (run as a user would, in a subprocess)."""

from __future__ import annotations

import subprocess
import sys

import pytest

CASES = [
    (["layer", "--ep", "0"], "--ep must be >= 1, got 0"),
    (["layer", "--ep", "-1"], "--ep must be >= 1, got -1"),
    (["layer", "--ep", "3"], "--ep 3 does not divide the 8 experts of config 'tiny-test'"),
    (["layer", "--ep", "16"], "--ep 16 does not divide the 8 experts"),
    (["layer", "--ep", "100"], "--ep 100 exceeds one NVLink domain (72 GPUs)"),
    (["layer", "--tokens", "0"], "--tokens must be >= 1, got 0"),
    (["layer", "--config", "doesnotexist"], "--config 'doesnotexist'"),
    (["tune", "--config", "tiny-test", "--ep", "0"], "--ep must be >= 1, got 0"),
    (["tune", "--config", "tiny-test", "--ep", "1", "--iters", "0"], "--iters must be >= 1, got 0"),
]


@pytest.mark.parametrize("argv,message", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_arguments_are_one_clear_line(argv, message):
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "megatron_mok.cli", *argv], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    ours = [ln for ln in proc.stderr.splitlines() if ln.startswith("mok: ")]
    assert len(ours) == 1 and message in ours[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_a_failing_rank_prints_its_error_once():
    """An error inside a spawned rank: its own message, once, no spawn-wrapper traceback (unless --verbose)."""
    env = {**__import__("os").environ, "MOK_BACKEND": "bogus"}
    cmd = [sys.executable, "-W", "ignore", "-m", "megatron_mok.cli", "layer", "--ep", "1", "--tokens", "8"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    ours = [ln for ln in proc.stderr.splitlines() if ln.startswith("mok: ")]
    assert ours == [
        "mok: rank 0 failed: megatron_mok.backend.MokBackendError: MOK_BACKEND='bogus' is not one of "
        "auto, reference, kernel"
    ], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    verbose = subprocess.run([*cmd, "--verbose"], capture_output=True, text=True, timeout=300, env=env)
    assert verbose.returncode != 0 and "Traceback" in verbose.stderr


def test_training_example_checks_its_arguments():
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "train_gpt_moe.py"
    for argv, message in ((["--steps", "0"], "--steps must be >= 1, got 0"), (["--ep", "3"], "--ep 3 does not divide")):
        proc = subprocess.run(
            [sys.executable, "-W", "ignore", str(script), *argv], capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_check_gives_a_verdict():
    cmd = [sys.executable, "-m", "megatron_mok.cli", "layer", "--ep", "1", "--tokens", "64", "--check"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "(tolerance 1e-05): PASS" in proc.stdout, proc.stdout
    assert "UserWarning" not in proc.stderr, proc.stderr[-2000:]  # Megatron's optional-package notes filtered
