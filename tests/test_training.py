"""A real Megatron-Core GPT-MoE trains the same with ``mok`` as with ``alltoall`` (CPU, reference)."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import train_gpt_moe  # noqa: E402


@pytest.mark.slow
def test_gpt_moe_training_curves_match(tmp_path):
    out = tmp_path / "curves"
    train_gpt_moe.main(["--ep", "2", "--steps", "12", "--out", str(out)])
    for rank in range(2):
        curves = json.loads((tmp_path / f"curves.{rank}").read_text())
        a, m = curves["alltoall"], curves["mok"]
        assert len(a) == len(m) == 12
        assert curves["max_gap"] < 1e-4, f"rank {rank}: loss curves diverge by {curves['max_gap']}"
        assert m[-1] < m[0] - 0.5, f"rank {rank}: loss did not go down ({m[0]:.3f} -> {m[-1]:.3f})"


@pytest.mark.slow
def test_gpt_moe_bf16_training_on_cpu(tmp_path):
    # bf16 end to end (every parameter bf16, as Megatron's Float16Module makes it; a GPU's layer_norm
    # rejects fp32 norm weights with bf16 activations), reference backend, EP = 1
    out = tmp_path / "curves"
    train_gpt_moe.main(["--ep", "1", "--steps", "8", "--dtype", "bf16", "--out", str(out)])
    curves = json.loads((tmp_path / "curves.0").read_text())
    a, m = curves["alltoall"], curves["mok"]
    assert m[-1] < m[0] - 0.3, f"loss did not go down ({m[0]:.3f} -> {m[-1]:.3f})"
    assert curves["max_gap"] < 0.05 * a[0], curves["max_gap"]
    assert curves["param_dtypes"] == ["torch.bfloat16"], curves["param_dtypes"]


def test_loss_table_shows_both_curves():
    curves = {"alltoall": [4.0 - 0.1 * i for i in range(25)], "mok": [4.0 - 0.1 * i + 1e-7 for i in range(25)]}
    table = train_gpt_moe.loss_table(curves, ["reference"], 1e-7).splitlines()
    assert table[0].split()[:3] == ["step", "alltoall", "mok"]
    rows = [ln.split() for ln in table[1:-1]]
    assert [int(r[0]) for r in rows][0] == 0 and int(rows[-1][0]) == 24  # first and last step always shown
    assert all(abs(float(r[1]) - curves["alltoall"][int(r[0])]) < 1e-6 for r in rows)
    assert "largest gap between the curves over 25 steps: 1.000e-07" in table[-1]


class _TwoParams(torch.nn.Module):
    """One shared parameter and one expert parameter (the name decides how clip_grad_norm counts it)."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = torch.nn.Parameter(torch.zeros(3))
        self.experts = torch.nn.Parameter(torch.zeros(4))


def _clip_on_rank(rank: int, ws: int, out: str) -> None:
    model = _TwoParams()
    model.shared.grad = torch.tensor([3.0, 0.0, 4.0])  # equal on every rank (already averaged)
    model.experts.grad = torch.full((4,), float(rank + 1))  # each rank's own experts
    train_gpt_moe.clip_grad_norm(model, ws)
    torch.save({"shared": model.shared.grad, "experts": model.experts.grad}, f"{out}.{rank}")


@pytest.mark.slow
def test_clip_grad_norm_uses_the_global_norm_over_the_ep_ranks(tmp_path):
    from megatron_mok.testing import spawn

    out = str(tmp_path / "grads")
    spawn(_clip_on_rank, 2, out)
    got = [torch.load(f"{out}.{r}") for r in range(2)]
    # global norm: the shared grad once (25) and both ranks' expert grads (4 * 1 + 4 * 4): sqrt(45)
    scale = train_gpt_moe.CLIP_GRAD / 45**0.5
    for r in range(2):
        torch.testing.assert_close(got[r]["shared"], torch.tensor([3.0, 0.0, 4.0]) * scale)
        torch.testing.assert_close(got[r]["experts"], torch.full((4,), float(r + 1)) * scale)
    total = got[0]["shared"].square().sum() + sum(g["experts"].square().sum() for g in got)
    assert abs(float(total.sqrt()) - train_gpt_moe.CLIP_GRAD) < 1e-5


def test_clip_grad_norm_leaves_small_gradients_alone():
    model = _TwoParams()
    model.shared.grad = torch.tensor([0.3, 0.0, 0.4])
    model.experts.grad = torch.zeros(4)
    train_gpt_moe.clip_grad_norm(model, 1)
    torch.testing.assert_close(model.shared.grad, torch.tensor([0.3, 0.0, 0.4]))
