"""Let Megatron-Core's own ``alltoall`` dispatcher run on CPU/gloo, as the oracle for MoK.

MoEAlltoAllTokenDispatcher overlaps device-to-host copies on a side CUDA stream and allocates
collective outputs on ``torch.cuda.current_device()``. On a CPU-only machine those calls have
nothing to do: streams become no-ops, the "current device" is the CPU, and split sizes (kept as
CPU tensors instead of numpy arrays when no copy happens) are passed to gloo as lists. The
dispatcher's own permute / all-to-all / sort-chunks / unpermute logic runs unchanged.
Only for test processes: never imported by the package.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


class _NoStream:
    def wait_stream(self, _s) -> None:
        pass

    def record_event(self):
        return _NoEvent()

    def synchronize(self) -> None:
        pass

    def __eq__(self, other) -> bool:
        return isinstance(other, _NoStream)

    def __hash__(self) -> int:
        return 0


class _NoEvent:
    def synchronize(self) -> None:
        pass

    def wait(self, *_a) -> None:
        pass


def install() -> None:
    if torch.cuda.is_available() or getattr(torch.cuda, "_mok_cpu_shim", False):
        return
    stream = _NoStream()
    torch.cuda.Stream = lambda *a, **k: stream  # type: ignore[assignment]
    torch.cuda.current_stream = lambda *a, **k: stream  # type: ignore[assignment]
    torch.cuda.stream = lambda _s: contextlib.nullcontext()  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    original = dist.all_to_all_single

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        as_list = lambda s: s.tolist() if hasattr(s, "tolist") else s  # noqa: E731
        return original(
            output, input, as_list(output_split_sizes), as_list(input_split_sizes), group=group, async_op=async_op
        )

    dist.all_to_all_single = all_to_all_single
    from megatron.core.tensor_parallel import mappings

    if getattr(mappings, "dist", None) is dist:
        pass  # mappings calls torch.distributed.all_to_all_single through the module: patched above
    torch.cuda._mok_cpu_shim = True  # type: ignore[attr-defined]
