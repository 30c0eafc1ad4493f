"""benchmarks/train_throughput.py at tiny sizes on CPU (one process, gloo, the reference backend)."""

from __future__ import annotations

import json
from types import ModuleType

import pytest
from load_script import load_script

TINY = [
    "--hidden", "64", "--ffn", "32", "--experts", "4", "--topk", "2", "--layers", "1", "--heads", "4",
    "--seq", "16", "--batch", "2", "--vocab", "128", "--steps", "2", "--warmup", "1", "--dtype", "fp32",
]  # fmt: skip


def _load() -> ModuleType:
    return load_script("train_throughput", "benchmarks")


def test_both_dispatchers_timed_on_the_same_model_and_data(tmp_path, capsys):
    bench = _load()
    out = tmp_path / "train.json"
    plot = tmp_path / "loss.png"
    bench.main([*TINY, "--json", str(out), "--plot", str(plot)])
    printed = capsys.readouterr().out
    record = json.loads(out.read_text())
    assert record["benchmark"] == "train_throughput" and record["shape"]["hidden"] == 64
    figures = {r["dispatcher"]: r for r in record["figures"]}
    assert list(figures) == ["alltoall", "mok"]
    for r in figures.values():
        assert r["ms_per_iter"] > 0 and r["ms_min"] <= r["ms_per_iter"] <= r["ms_max"], r
        assert r["tokens_per_s"] == pytest.approx(2 * 16 / (r["ms_per_iter"] / 1e3))
        assert len(r["iter_ms"]) == 2  # the timed iterations only
        assert len(r["losses"]) == 3  # every iteration's loss, warm-up included
    assert figures["alltoall"]["speedup_vs_alltoall"] == 1.0
    a, m = figures["alltoall"], figures["mok"]
    assert m["speedup_vs_alltoall"] == pytest.approx(a["ms_per_iter"] / m["ms_per_iter"])
    assert m["backend"] == "reference"  # no GPU here
    # same seed, same data: the two runs train the same model the same way
    assert record["max_loss_gap"] < 1e-4, (a["losses"], m["losses"])
    assert "largest gap between the curves over 3 steps" in printed
    assert plot.exists() or "no plot: matplotlib is not installed" in printed


def test_a_bad_option_is_one_line_and_status_2(capsys):
    bench = _load()
    with pytest.raises(SystemExit) as exc:
        bench.main([*TINY, "--steps", "0"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["train_throughput.py: --steps must be >= 1, got 0"], err
