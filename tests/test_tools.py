"""The comparison harness and the tuner: what runs without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from load_script import load_script

from megatron_mok.config import load_config, min_minibatch_tokens
from megatron_mok.tuner import candidate_grid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tuner_candidates_respect_the_two_wave_rule():
    cfg = load_config("kimi-k2")
    cands = list(candidate_grid(cfg, [8, 20], None, [2, 4]))
    assert len(cands) == 2 * 3 * 2
    for c, mb, s in cands:
        assert mb >= min_minibatch_tokens(2048, 132 - c) and s in (2, 4)
    tuned = cfg.replace_kernel(comm_sms=8, ring_slots=3)
    assert (tuned.kernel.comm_sms, tuned.kernel.ring_slots, tuned.kernel.minibatch_tokens) == (8, 3, 4096)
    # the in-SM pull (comm 0) is a default candidate when the config sets the backward's own comm SMs
    assert {c for c, _, _ in candidate_grid(cfg, None, None, None)} == {0, 4, 8, 12, 16, 20, 24}


def test_tuner_without_gpu_is_a_clear_error():
    import torch

    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    from megatron_mok.tuner import tune

    with pytest.raises(RuntimeError, match="needs a GPU that runs the MoK kernel"):
        tune("kimi-k2", ep=64, tokens=128)


@pytest.mark.slow
def test_compare_dispatchers_runs_and_skips_missing_backends(tmp_path):
    out = tmp_path / "cmp.json"
    env = dict(os.environ, PYTHONPATH=REPO, PYTHONWARNINGS="ignore")
    env.pop("RANK", None)
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "benchmarks", "compare_dispatchers.py"),
            "--config",
            "tiny-test",
            "--tokens",
            "64",
            "--iters",
            "1",
            "--warmup",
            "1",
            "--json",
            str(out),
            "--plot",
            str(tmp_path / "p.png"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[skip] flex-hybridep" in proc.stdout
    res = {r["dispatcher"]: r for r in json.loads(out.read_text())["figures"]}
    assert {"mok", "alltoall"} <= set(res)
    assert all(r["fwd_ms"] > 0 and r["tokens_per_s"] > 0 for r in res.values())


def test_tuner_refuses_a_dtype_without_a_kernel_here(tmp_path):
    import pytest
    import yaml

    from megatron_mok.config import CONFIG_DIR
    from megatron_mok.tuner import tune

    raw = yaml.safe_load((CONFIG_DIR / "kimi-k2.yaml").read_text())
    raw["kernel"].update(dtype="mxfp8", arch="sm_100a")
    path = tmp_path / "kimi-mxfp8.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ValueError, match="kernel.dtype 'mxfp8' has no kernel"):
        tune(str(path), ep=48, tokens=64)


def test_long_run_refuses_bad_options_in_one_line(capsys):
    long_run = load_script("long_run")
    for argv, needle in (
        (["--steps", "0"], "--steps must be >= 1"),
        (["--dtype", "fp16"], "unknown 'fp16'"),
        (["--topk", "9", "--experts", "8"], "--topk 9 exceeds --experts 8"),
    ):
        with pytest.raises(SystemExit) as e:
            long_run.main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert needle in err, err
