"""CPU: the symmetric-region layout of per-rank launches (offsets, alignment, bad sizes)."""

from __future__ import annotations

import pytest

from megatron_mok.kernel.comm import SIGNAL_KINDS, PeerRegion
from megatron_mok.kernel.ops import MOK_MAX_RANKS


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


def test_region_without_fp8_sources_has_no_copy():
    r = PeerRegion.plan(tokens_cap=64, hidden=256, topk=2)
    assert not r.fp8_sources and r.xq_off == r.xs_off == -1


def test_region_with_fp8_sources_appends_the_copy():
    """The FP8 forward's source-quantised copy: the e4m3 rows and their 1 x 128 scales after the signal pad, aligned and
    disjoint; every other offset as without them (the backward reads the same region)."""
    plain = PeerRegion.plan(tokens_cap=8192, hidden=7168, topk=8)
    r = PeerRegion.plan(tokens_cap=8192, hidden=7168, topk=8, fp8_sources=True)
    assert r.fp8_sources
    for f in ("x_off", "idx_off", "combine_off", "topk_w_off", "grad_out_off", "signal_off"):
        assert getattr(r, f) == getattr(plain, f), f
    assert r.xq_off == plain.nbytes  # after the signal pad
    assert r.xs_off % 1024 == 0 and r.xs_off >= r.xq_off + 8192 * 7168
    assert r.nbytes % 1024 == 0 and r.nbytes >= r.xs_off + 8192 * (7168 // 128) * 4


def test_region_fp8_sources_need_whole_scale_blocks():
    with pytest.raises(ValueError, match="multiple of 128"):
        PeerRegion.plan(16, 192, 2, fp8_sources=True)
