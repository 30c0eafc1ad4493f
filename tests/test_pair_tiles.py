"""CPU check of the 2-CTA cluster tile pairs (MOK_CLUSTER=2; csrc/mok/pair_tiles.cuh).

The kernel's own header is compiled for the host with nvcc (tests/pair_tiles_check.cu) and run here: every
tile of every minibatch in exactly one unit, with the rows the forward's row-block enumeration gives it.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.nvcc

ROOT = Path(__file__).resolve().parents[1]


def test_pair_units_cover_every_tile_once(tmp_path: Path) -> None:
    from megatron_mok.kernel import build

    nvcc = build.find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found")
    exe = tmp_path / "pair_tiles_check"
    cmd = [str(nvcc), "-std=c++17", "-O1", "-arch=sm_90a", f"-I{ROOT / 'csrc' / 'mok'}"]
    cmd += [str(ROOT / "tests" / "pair_tiles_check.cu"), "-o", str(exe)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = subprocess.run([str(exe), "3000"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.startswith("ok:"), run.stdout
    # the cases must exercise both kinds of unit and the passes
    counts = run.stdout.split("(")[1]
    assert not counts.startswith("0 shared") and ", 0 passes" not in counts, run.stdout
