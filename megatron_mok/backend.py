"""Choosing between the CUDA megakernel and the PyTorch reference.

``MOK_BACKEND`` = ``auto`` (default: the kernel where it can run, else the reference),
``reference`` or ``kernel`` (an error if the kernel cannot run, instead of a quiet fallback).
"""

from __future__ import annotations

import logging

import torch

from . import env
from .reference import ReferenceBackend

logger = logging.getLogger(__name__)

_CHOICES = ("auto", "reference", "kernel")


class MokBackendError(RuntimeError):
    pass


def requested_backend() -> str:
    try:
        return env.backend()
    except env.MokEnvError as exc:
        raise MokBackendError(str(exc)) from None


def kernel_unavailable_reason(
    device: torch.device | None = None,
    world_size: int = 1,
    dtype: str = "bf16",
    tensor_dtype: torch.dtype | None = None,
    hidden: int | None = None,
    ffn: int | None = None,
) -> str | None:
    """None when the kernel can run this call, else why not."""
    if device is not None and device.type != "cuda":
        return f"tensors are on {device.type}, the kernel needs CUDA"
    if tensor_dtype is not None and tensor_dtype != torch.bfloat16:
        return f"activations are {tensor_dtype}, the kernel runs bf16"
    tile = 128 if dtype == "fp8" else 64  # the kernels' column tiles (fp8: also the 128 x 128 scale blocks)
    for name, size in (("hidden", hidden), ("ffn", ffn)):
        if size is not None and size % tile:
            return f"{name} size {size} is not a multiple of {tile} ({dtype} kernel tiles)"
    try:
        from . import kernel
    except Exception as exc:  # noqa: BLE001 - any import failure means "no kernel"
        return f"megatron_mok.kernel failed to import: {exc}"
    if not kernel.is_available():
        return kernel.unavailable_reason()
    if dtype not in ("bf16", "fp8"):
        return f"kernel dtype {dtype} is not built for this GPU (Hopper runs bf16 and fp8)"
    if world_size != 1 and not _symmetric_memory_available():
        return "EP > 1 needs torch symmetric memory (torch.distributed._symmetric_memory), not available here"
    return None


def _symmetric_memory_available() -> bool:
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


_KERNEL_BACKENDS: dict = {}


def kernel_backend(
    comm_sms: int,
    timeout_ms: float,
    backward_comm_sms: int = 0,
    owner_capacity_factor: float = 0.0,
    dtype: str = "bf16",
    backward_minibatch_tokens: int = 0,
    tuning=None,
):
    """One KernelBackend per setting, shared by every MoK layer of the process: at EP > 1 it owns the
    symmetric-memory PeerBuffers (allocated collectively once, not per call) whose signal epochs every
    layer's forward and backward advance in the same order on all ranks."""
    from .kernel_backend import KernelBackend

    key = (
        int(comm_sms),
        float(timeout_ms),
        int(backward_comm_sms),
        float(owner_capacity_factor),
        dtype,
        int(backward_minibatch_tokens),
        tuning,
    )
    b = _KERNEL_BACKENDS.get(key)
    if b is None:
        b = _KERNEL_BACKENDS[key] = KernelBackend(
            comm_sms=comm_sms,
            timeout_ms=timeout_ms,
            backward_comm_sms=backward_comm_sms,
            owner_capacity_factor=owner_capacity_factor,
            dtype=dtype,
            backward_minibatch_tokens=backward_minibatch_tokens,
            tuning=tuning,
        )
    return b


def select_backend(
    device: torch.device,
    world_size: int,
    dtype: str = "bf16",
    tensor_dtype: torch.dtype | None = None,
    comm_sms: int = 20,
    timeout_ms: float = 10000.0,
    backward_comm_sms: int = 0,
    owner_capacity_factor: float = 0.0,
    backward_minibatch_tokens: int = 0,
    tuning=None,
    hidden: int | None = None,
    ffn: int | None = None,
):
    """The backend of one layer call (``hidden`` / ``ffn``: the expert sizes, which the kernel's tiles must divide);
    ``tuning``: the config's ``kernel.tuning.ForwardTuning`` (None: defaults)."""
    want = requested_backend()
    if dtype != "bf16":
        # only the kernel has the FP8 recipe: a reference (bf16 / fp32) run instead would silently change
        # numerics and speed, so anything but the kernel is an error
        reason = (
            "MOK_BACKEND=reference"
            if want == "reference"
            else kernel_unavailable_reason(device, world_size, dtype, tensor_dtype, hidden, ffn)
        )
        if reason is not None:
            raise MokBackendError(
                f"kernel.dtype {dtype!r} runs only on the MoK kernel (Hopper sm_90a: bf16, fp8), which cannot run "
                f"here: {reason}; set kernel.dtype: bf16 in the MoK config"
            )
        return kernel_backend(
            comm_sms, timeout_ms, backward_comm_sms, owner_capacity_factor, dtype, backward_minibatch_tokens, tuning
        )
    if want == "reference":
        return ReferenceBackend()
    reason = kernel_unavailable_reason(device, world_size, dtype, tensor_dtype, hidden, ffn)
    if reason is None:
        return kernel_backend(
            comm_sms, timeout_ms, backward_comm_sms, owner_capacity_factor, "bf16", backward_minibatch_tokens, tuning
        )
    if want == "kernel":
        raise MokBackendError(f"MOK_BACKEND=kernel but the MoK kernel cannot run: {reason}")
    logger.debug("MoK: reference backend (%s)", reason)
    return ReferenceBackend(reason)


def describe_backend() -> str:
    reason = kernel_unavailable_reason(torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    if reason is None:
        return "kernel: MoK CUDA megakernel (sm_90a)"
    return f"reference: PyTorch MoK reference ({reason})"
