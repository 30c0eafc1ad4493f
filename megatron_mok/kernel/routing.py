"""Megatron's dense routing (``routing_map`` / ``probs`` [T, E]) to the kernels' top-k form in one device launch
(``mok::topk_from_routing_map``, ``csrc/mok/routing/topk_from_map.cuh``): what ``layout.topk_from_routing_map``
computes with a dozen tensor operations, each a launch the host pays for in every layer call.

The ids are int32 (the kernels' dtype), in ascending expert order, -1 with probability 0 past a token's routed
experts. A token routed to more than top-k experts is marked with ``layout.OVER_ROUTED`` in its last slot, not
checked here (a check would synchronise the host): the kernels' schedule and ``layout.validate_routing`` report it.
The probabilities keep autograd to ``probs``.
"""

from __future__ import annotations

import torch

from . import is_available


def runs_on_device(routing_map: torch.Tensor, probs: torch.Tensor) -> bool:
    """Whether the device op takes this routing: a bool CUDA map, fp32 / bf16 probs, and the MoK kernels here."""
    return (
        routing_map.is_cuda
        and routing_map.dtype == torch.bool
        and probs.dtype in (torch.float32, torch.bfloat16)
        and is_available()
    )


def topk_from_routing_map(
    routing_map: torch.Tensor, probs: torch.Tensor, topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k expert ids [T, K] int32 and their probabilities [T, K] (see the module docstring)."""
    return torch.ops.mok.topk_from_routing_map(routing_map.contiguous(), probs.contiguous(), topk)
