"""The lazy error reader (``megatron_mok.kernel.errors``): launches' error records copied behind them and read by
a later call without a host sync. A record is never overwritten before it is read, however many launches are still
running when the reader's slots wrap round, and a clean run leaves nothing pending."""

from __future__ import annotations

import pytest
import torch

from megatron_mok.kernel import errors

pytestmark = pytest.mark.gpu


def _record(code: int, rank: int, stream: torch.cuda.Stream | None = None) -> torch.Tensor:
    """A launch's error record on the GPU, made before any sleep: a new allocation (cudaMalloc) or a tensor element
    set from Python (a pageable copy) waits for the GPU, which would let the sleeping work finish first."""
    with torch.cuda.stream(stream or torch.cuda.current_stream()):
        return torch.tensor([code, rank] + [0] * 14, dtype=torch.int32, device="cuda")


def _records(reader: errors._LazyErrorChecker, n: int, failed: int | None) -> None:
    """n records on the current stream, launch ``failed`` (if any) with an error, behind a ~0.1 s GPU sleep so that
    none has finished while the host hands them all to the reader."""
    errs = [_record(1, 7) if i == failed else _record(0, 0) for i in range(n)]
    torch.cuda._sleep(200_000_000)
    for i, err in enumerate(errs):
        reader.after_launch(err, None, lambda v, i=i: f"launch {i}: code {v[0]}, rank {v[1]}")
        # until the slots come round every record is still pending: the sleep outlasts the loop
        assert i >= reader.SLOTS or len(reader.pending) == i + 1, "records finished before all were handed over"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_record_is_read_before_its_slot_is_used_again():
    reader = errors._LazyErrorChecker()
    with pytest.raises(errors.MokKernelError, match="launch 3: code 1, rank 7"):
        _records(reader, reader.SLOTS + 8, failed=3)  # slot 3 comes round again while launch 3 is unread
    reader.drain()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_slow_stream_keeps_its_slot_while_others_finish():
    """Records finish out of order across streams: a failed launch on a slow stream keeps its slot while a fast
    stream's records are read and freed (few pending at any time), until its slot comes round again."""
    reader = errors._LazyErrorChecker()
    slow, fast = torch.cuda.Stream(), torch.cuda.Stream()
    err = _record(1, 5, slow)
    oks = [_record(0, 0, fast) for _ in range(reader.SLOTS)]
    torch.cuda.synchronize()
    with torch.cuda.stream(slow):
        torch.cuda._sleep(400_000_000)
    reader.after_launch(err, slow, lambda v: f"slow launch: code {v[0]}, rank {v[1]}")
    with pytest.raises(errors.MokKernelError, match="slow launch: code 1, rank 5"):
        for i, ok in enumerate(oks):
            assert i == reader.SLOTS - 1 or not reader.events[0].query(), "the slow launch finished too soon"
            reader.after_launch(ok, fast, lambda v, i=i: f"fast launch {i}")
            fast.synchronize()  # read and freed at the next call, while the slow one still sleeps
            assert len(reader.pending) <= 2
    reader.drain()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_clean_launches_leave_nothing_pending():
    reader = errors._LazyErrorChecker()
    _records(reader, 2 * reader.SLOTS + 5, failed=None)
    reader.drain()
    assert reader.pending == [] and not any(reader.unread)
    _records(reader, 5, failed=2)  # and a failure after the slots went round twice is still found
    with pytest.raises(errors.MokKernelError, match="launch 2: code 1, rank 7"):
        reader.drain()
