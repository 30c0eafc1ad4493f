"""The differentiable MoK layer: one autograd node over a backend.

A backend (the PyTorch reference, ``reference.ReferenceBackend``, or the CUDA megakernels,
``kernel_backend.KernelBackend``) implements :class:`MokBackend`: ``forward`` returns the layer output and a state
of its own type (a dataclass registered as a pytree node, so its tensors are saved for the backward as autograd
saves tensors), ``backward`` takes that state back. The node saves the expert weights, hands Megatron's
``main_grad`` to a backend whose wgrad can add into it (gradient-accumulation fusion), and returns what autograd
expects for every input.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch.utils import _pytree as pytree

from .plan import MokPlan


class MokBackend(Protocol):
    """What the autograd node needs from a backend."""

    name: str

    def forward(
        self, plan: MokPlan, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, w1: list, w2: list
    ) -> tuple[torch.Tensor, Any]:
        """The layer output [T, H] and the backend's state for its backward."""
        ...

    def backward(
        self, plan: MokPlan, state: Any, grad_out: torch.Tensor, w1: list, w2: list, main_grads=None
    ) -> tuple[torch.Tensor, torch.Tensor, list, list]:
        """(grad_x, grad_topk_weight, grad_w1 per expert, grad_w2 per expert); with ``main_grads`` (fc1 list, fc2
        list) the weight gradients are added into those and they are returned."""
        ...

    def can_accumulate_main_grad(self, main_grads) -> bool:
        """Whether ``backward(..., main_grads=...)`` can add straight into these tensors."""
        ...


class MokMoEFunction(torch.autograd.Function):
    """Autograd node of the fused MoK layer; a :class:`MokBackend` computes forward and backward behind it."""

    @staticmethod
    def forward(ctx, x, topk_idx, topk_w, plan: MokPlan, backend, num_w1: int, *weights):  # type: ignore[override]
        w1, w2 = list(weights[:num_w1]), list(weights[num_w1:])
        out, state = backend.forward(plan, x, topk_idx, topk_w, w1, w2)
        # the state's tensors are saved as autograd saves tensors (torch.compile traces them so), the rest of it
        # (its structure and constants) stays on the context
        leaves, ctx.state_spec = pytree.tree_flatten(state)
        ctx.state_consts = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        ctx.save_for_backward(*weights, *[leaf for leaf in leaves if isinstance(leaf, torch.Tensor)])
        ctx.plan, ctx.backend, ctx.num_w1, ctx.num_weights = plan, backend, num_w1, len(weights)
        ctx.params = weights  # the Parameter objects: main_grad lives on them
        ctx.topk_w_dtype = topk_w.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        saved = ctx.saved_tensors
        weights, tensors = saved[: ctx.num_weights], iter(saved[ctx.num_weights :])
        leaves = [next(tensors) if c is None else c for c in ctx.state_consts]
        state = pytree.tree_unflatten(leaves, ctx.state_spec)
        w1, w2 = list(weights[: ctx.num_w1]), list(weights[ctx.num_w1 :])
        fuse = ctx.plan.fuse_wgrad_into_main_grad
        mains = [getattr(p, "main_grad", None) for p in ctx.params] if fuse else []
        in_kernel = fuse and ctx.backend.can_accumulate_main_grad(mains)
        if in_kernel:  # the backend's wgrad adds straight into main_grad (no fp32 temporaries, no add pass)
            gx, gw, gw1, gw2 = ctx.backend.backward(
                ctx.plan, state, grad_out, w1, w2, main_grads=(mains[: ctx.num_w1], mains[ctx.num_w1 :])
            )
        else:
            gx, gw, gw1, gw2 = ctx.backend.backward(ctx.plan, state, grad_out, w1, w2)
        wgrads = [weight_grad_for_autograd(p, g, fuse, added=in_kernel) for p, g in zip(ctx.params, [*gw1, *gw2])]
        ctx.params = None
        return (gx, None, gw.to(ctx.topk_w_dtype), None, None, None, *wgrads)


def weight_grad_for_autograd(weight: torch.Tensor, grad: torch.Tensor, fuse_into_main_grad: bool, added: bool = False):
    """What the autograd node returns for an expert weight.

    With Megatron's gradient-accumulation fusion the gradient is added to ``weight.main_grad``
    (fp32) here (``added``: the backend's wgrad already added it there) and, like Megatron's own
    linear layers, a dummy tensor is returned when the parameter carries ``grad_added_to_main_grad``
    (so DDP's hooks still fire on the main thread).
    """
    main_grad = getattr(weight, "main_grad", None) if fuse_into_main_grad else None
    if main_grad is None:
        return grad.to(weight.dtype)
    if not added:
        main_grad.add_(grad.to(main_grad.dtype))
    if hasattr(weight, "grad_added_to_main_grad"):
        weight.grad_added_to_main_grad = True
        if getattr(weight, "zero_out_wgrad", False):
            return torch.zeros(main_grad.shape, dtype=weight.dtype, device=weight.device)
        return torch.empty(main_grad.shape, dtype=weight.dtype, device=weight.device)
    return None


def mok_moe(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_w: torch.Tensor,
    w1: Sequence[torch.Tensor],
    w2: Sequence[torch.Tensor],
    plan: MokPlan,
    backend=None,
) -> torch.Tensor:
    """The whole MoE layer (dispatch, experts, combine) for one rank, differentiable."""
    if backend is None:
        from .reference import ReferenceBackend

        backend = ReferenceBackend()
    return MokMoEFunction.apply(x, topk_idx, topk_w, plan, backend, len(w1), *w1, *w2)
