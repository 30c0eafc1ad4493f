"""CPU: the symmetric-region layout of per-rank launches (offsets, alignment, bad sizes)."""

from __future__ import annotations

import pytest

from megatron_mok.kernel.emulated import MOK_MAX_RANKS
from megatron_mok.kernel.peer_ep import SIGNAL_KINDS, PeerRegion


def test_region_layout_is_aligned_and_disjoint():
    r = PeerRegion.plan(tokens_cap=8192, hidden=7168, topk=8)
    spans = [
        (r.x_off, 8192 * 7168 * 2),
        (r.idx_off, 8192 * 8 * 4),
        (r.combine_off, 8192 * 8 * 7168 * 2),
        (r.topk_w_off, 8192 * 8 * 4),
        (r.grad_out_off, 8192 * 7168 * 2),
        (r.signal_off, SIGNAL_KINDS * MOK_MAX_RANKS * 4),
    ]
    end = 0
    for off, n in spans:
        assert off % 1024 == 0 and off >= end  # TMA / 16-byte vector access, no overlap
        end = off + n
    assert r.nbytes >= end and r.nbytes % 1024 == 0


@pytest.mark.parametrize("cap,h,k", [(0, 128, 2), (16, 0, 2), (16, 128, 0)])
def test_region_rejects_empty_sizes(cap, h, k):
    with pytest.raises(ValueError, match="must be >= 1"):
        PeerRegion.plan(cap, h, k)
