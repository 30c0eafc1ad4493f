"""megatron-mok: the Mixture-of-Kittens fused MoE megakernel as a Megatron-Core token dispatcher.

``import megatron_mok`` is cheap and safe on any machine. Registering the ``mok`` dispatcher
with Megatron-Core (``megatron_mok.register()``) patches nothing until called; it is called by
the launcher (``mok-pretrain-gpt``) and by ``megatron_mok.megatron`` users explicitly.
"""

from __future__ import annotations

from .config import MokConfig, MokConfigError, load_config, resolve_config, set_active_config

__version__ = "0.1.0"

__all__ = [
    "MokConfig",
    "MokConfigError",
    "__version__",
    "backend_info",
    "load_config",
    "register",
    "resolve_config",
    "set_active_config",
]


def register() -> None:
    """Make ``moe_token_dispatcher_type="mok"`` and ``--moe-token-dispatcher-type mok`` work."""
    from .registration import register as _register

    _register()


def backend_info() -> str:
    """Which MoK backend runs here, and why (the CUDA kernel or the PyTorch reference)."""
    from .backend import describe_backend

    return describe_backend()
