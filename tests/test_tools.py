"""The comparison harness and the tuner: what runs without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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


class _FakeWorker:
    """A compare_trees worker without a GPU: a case takes 1.0 ms times the tree's speed factor times the shared
    clock's drift at the moment it is timed (the drift a power-capped GPU shows between rounds)."""

    clock = [0]
    log: list[str] = []
    factors = {"a": 1.0, "b": 0.9}
    flip_bits_after_timing: str | None = None

    def __init__(self, label, tree, iters):
        self.label, self.cases, self.timed = label, ["kimi-k2 fp8", "deepseek-v3 fp8"], 0
        type(self).log.append(f"start {label}")

    def ask(self, request):
        if request == "sums":
            flip = self.timed and self.label == type(self).flip_bits_after_timing
            return {c: {"out": "x" if flip else "0"} for c in self.cases}
        type(self).clock[0] += 1
        self.timed += 1
        type(self).log.append(f"{request} {self.label}")
        drift = 1.0 + 0.2 * (type(self).clock[0] // 6 % 2)  # changes every few calls, as the clock does
        t = self.factors[self.label] * drift
        return {"forward_ms": t, "backward_ms": 2 * t, "forward_host_us": 50.0, "backward_host_us": 90.0}

    def close(self):
        type(self).log.append(f"close {self.label}")


def _paired_with_fake(monkeypatch, flip=None):
    ct = load_script("compare_trees")
    _FakeWorker.clock[0], _FakeWorker.log[:], _FakeWorker.flip_bits_after_timing = 0, [], flip
    monkeypatch.setattr(ct, "_Worker", _FakeWorker)
    return ct.run_pairs({"a": Path("/a"), "b": Path("/b")}, pairs=6, iters=1)


def test_compare_trees_paired_ratios_cancel_the_clock_drift(monkeypatch):
    report, ok = _paired_with_fake(monkeypatch)
    assert ok
    for case in ("kimi-k2 fp8", "deepseek-v3 fp8"):
        # every pair is timed inside one drift level or across one step, so the median pair reads the true 0.9
        ratios = report["cases"][case]["b"]["forward_ratios"]
        assert len(ratios) == 6 and sorted(ratios)[3] == pytest.approx(0.9)
        assert report["cases"][case]["b"]["forward_ratio_quartiles"][1] == pytest.approx(0.9)  # the median reported
        assert report["cases"][case]["a"]["forward_ratios"] == [1.0] * 6
    timed = [e for e in _FakeWorker.log if not e.startswith(("start", "close"))]
    # interleaved: each case is timed on both trees back to back, pair after pair
    assert all({timed[i].split()[-1], timed[i + 1].split()[-1]} == {"a", "b"} for i in range(0, len(timed), 2))
    assert [e.rsplit(" ", 1)[0] for e in timed[::2]] == ["kimi-k2 fp8", "deepseek-v3 fp8"] * 6
    for case in ("kimi-k2 fp8", "deepseek-v3 fp8"):  # each tree goes first in half of a case's pairs
        firsts = [e.split()[-1] for e in timed[::2] if e.startswith(case)]
        assert firsts.count("a") == firsts.count("b") == 3
    assert _FakeWorker.log[-2:] == ["close a", "close b"]


def test_compare_trees_paired_checks_bits_after_the_timings(monkeypatch):
    _, ok = _paired_with_fake(monkeypatch, flip="b")
    assert not ok


def test_compare_trees_worker_answers_on_its_own_channel():
    """The real serve loop with CPU stand-ins for the cases: the tree's prints must not reach the answers."""
    code = (
        "import os, sys; sys.path.insert(0, sys.argv[1]); from load_script import load_script\n"
        "ct = load_script('compare_trees')\n"
        "ct.SLICES = {'s': 1}\n"
        "ct._slice_inputs = lambda name: (print('tree chatter on stdout'), os.write(1, b'C-level chatter on fd 1\\n'))\n"
        "ct._prepare_case = lambda inputs, dtype: {'sums': lambda: {'out': dtype}}\n"
        "ct._time_case = lambda case, iters: {'forward_ms': 1.5, 'backward_ms': 2.5}\n"
        "ct._release_cached_memory = lambda: None\n"
        "ct.serve(3)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, os.path.dirname(__file__)], input="sums\ns bf16\nquit\n",
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert lines == [
        {"cases": ["s bf16", "s fp8"]},
        {"s bf16": {"out": "bf16"}, "s fp8": {"out": "fp8"}},
        {"forward_ms": 1.5, "backward_ms": 2.5},
    ]
    assert "tree chatter" in proc.stderr and "C-level chatter" in proc.stderr


def test_compare_trees_quartiles():
    ct = load_script("compare_trees")
    assert ct._quantiles([5.0, 1.0, 4.0, 2.0, 3.0]) == (2.0, 3.0, 4.0)
    assert ct._quantiles([7.0]) == (7.0, 7.0, 7.0)


def test_compare_trees_worker_that_ends_is_a_clear_error(monkeypatch):
    """A worker that ends while idle (here right after naming its cases) stops the run at the next request with the
    end of its log, not a broken pipe."""
    ct = load_script("compare_trees")
    stub = "import sys; print('{\"cases\": [\"c\"]}', flush=True); sys.stderr.write('worker log: out of memory\\n')"
    monkeypatch.setattr(ct, "_worker_command", lambda iters: [sys.executable, "-c", stub])
    w = ct._Worker("b", Path("."), 1)
    assert w.cases == ["c"]
    w.proc.wait()
    with pytest.raises(SystemExit, match=r"(?s)tree b .* worker ended .*worker log: out of memory"):
        w.ask("c")
    w.close()
