"""Plugging ``mok`` into Megatron-Core and Megatron-LM without forking them.

Megatron-Core picks its dispatcher with a hard-coded if/elif inside ``MoELayer.__init__`` and
has no registry, so :func:`register` does two small, idempotent things:

1. ``MoELayer.__new__`` returns a :class:`~megatron_mok.moe_layer.MokMoELayer` when the config
   asks for ``moe_token_dispatcher_type="mok"``. Every spec (``partial(MoELayer, ...)``), built
   before or after, picks it up; the layer is still an ``MoELayer`` for ``isinstance`` checks.
2. Megatron-LM's argument parser (``megatron.training.arguments.add_megatron_arguments``) gets
   ``mok`` among the ``--moe-token-dispatcher-type`` choices and a ``--mok-config`` option.

``TransformerConfig`` itself accepts ``"mok"`` as-is (its Literal annotation is not enforced).
"""

from __future__ import annotations

import argparse
import functools
import logging
from typing import Any

logger = logging.getLogger(__name__)

SUPPORTED_MCORE = ((0, 19), (0, 20))
_REGISTERED = False


def _mcore_version() -> tuple[int, int]:
    from megatron.core import package_info

    major, minor = package_info.__version__.split(".")[:2]
    return int(major), int(minor)


def _check_version() -> None:
    ver = _mcore_version()
    if ver not in SUPPORTED_MCORE:
        logger.warning(
            "megatron-mok was written against megatron-core %s; found %d.%d -- checking its MoE surfaces",
            " / ".join(f"{a}.{b}" for a, b in SUPPORTED_MCORE),
            *ver,
        )
    import inspect

    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

    params = list(inspect.signature(MoELayer.__init__).parameters)
    expected = ["self", "config", "submodules", "layer_number", "pg_collection"]
    if params[: len(expected)] != expected:
        raise RuntimeError(
            f"megatron-core MoELayer.__init__ has an unexpected signature {params}; megatron-mok needs updating"
        )
    if list(inspect.signature(MoETokenDispatcher.__init__).parameters)[:3] != ["self", "config", "pg_collection"]:
        raise RuntimeError("megatron-core MoETokenDispatcher.__init__ changed; megatron-mok needs updating")


def _patch_moe_layer() -> None:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from .moe_layer import MokMoELayer

    if getattr(MoELayer, "_mok_patched", False):
        return
    original_new = MoELayer.__new__

    def __new__(cls, *args: Any, **kwargs: Any):  # noqa: N807
        config = kwargs.get("config", args[0] if args else None)
        if cls is MoELayer and getattr(config, "moe_token_dispatcher_type", None) == "mok":
            cls = MokMoELayer
        if original_new is object.__new__:
            return object.__new__(cls)
        return original_new(cls, *args, **kwargs)

    MoELayer.__new__ = staticmethod(__new__)  # type: ignore[method-assign]
    MoELayer._mok_patched = True  # type: ignore[attr-defined]


def add_mok_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM ``extra_args_provider``: accept ``--moe-token-dispatcher-type mok`` and MoK options."""
    for action in parser._actions:
        if action.dest == "moe_token_dispatcher_type" and action.choices is not None and "mok" not in action.choices:
            action.choices = (*action.choices, "mok")
            action.help = (action.help or "") + " 'mok': megatron-mok fused MoE megakernel."
    if not any(a.dest == "mok_config" for a in parser._actions):
        group = parser.add_argument_group("megatron-mok")
        group.add_argument(
            "--mok-config",
            type=str,
            default=None,
            help="MoK kernel config: a bundled name (kimi-k2, deepseek-v3, ...) or a YAML path. "
            "Default: the bundled config matching the model, else derived from its sizes.",
        )
    return parser


def _patch_megatron_lm_args() -> bool:
    try:
        from megatron.training import arguments
    except Exception as exc:  # noqa: BLE001 - megatron.training is optional (Megatron-LM only)
        logger.debug("megatron.training not importable (%s); CLI flag not patched", exc)
        return False
    if getattr(arguments.add_megatron_arguments, "_mok_patched", False):
        return True
    original = arguments.add_megatron_arguments

    @functools.wraps(original)
    def add_megatron_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        return add_mok_args(original(parser))

    add_megatron_arguments._mok_patched = True  # type: ignore[attr-defined]
    arguments.add_megatron_arguments = add_megatron_arguments
    return True


def register() -> None:
    """Idempotently make ``mok`` a Megatron-Core / Megatron-LM token dispatcher type."""
    global _REGISTERED
    if _REGISTERED:
        return
    _check_version()
    _patch_moe_layer()
    _patch_megatron_lm_args()
    _REGISTERED = True
