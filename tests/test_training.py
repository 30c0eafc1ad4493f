"""A real Megatron-Core GPT-MoE trains the same with ``mok`` as with ``alltoall`` (CPU, reference)."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))


@pytest.mark.slow
def test_gpt_moe_training_curves_match(tmp_path):
    import train_gpt_moe

    out = tmp_path / "curves"
    train_gpt_moe.main(["--ep", "2", "--steps", "12", "--out", str(out)])
    for rank in range(2):
        curves = json.loads((tmp_path / f"curves.{rank}").read_text())
        a, m = curves["alltoall"], curves["mok"]
        assert len(a) == len(m) == 12
        assert curves["max_gap"] < 1e-4, f"rank {rank}: loss curves diverge by {curves['max_gap']}"
        assert m[-1] < m[0] - 0.5, f"rank {rank}: loss did not go down ({m[0]:.3f} -> {m[-1]:.3f})"
