"""``mok-pretrain-gpt``: run a Megatron-LM training script with the ``mok`` dispatcher registered.

Megatron-LM's ``pretrain_gpt.py`` builds its argument parser without a hook we could use, so
this launcher registers MoK (dispatcher + CLI flags) in-process and then runs the script
unchanged as ``__main__``::

    torchrun --nproc-per-node 8 -m megatron_mok.launch /path/to/Megatron-LM/pretrain_gpt.py \\
        --moe-token-dispatcher-type mok --mok-config kimi-k2 ...

Own scripts can instead call ``megatron_mok.register()`` before parsing arguments, or pass
``megatron_mok.registration.add_mok_args`` as ``extra_args_provider``.
"""

from __future__ import annotations

import os
import runpy
import sys


def _py311_compat() -> None:
    # megatron.training (0.19) imports typing.override, new in Python 3.12.
    import typing

    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override  # type: ignore[attr-defined]


def _prebuilt_dataset_helpers() -> bool:
    """Megatron-LM's initialize runs ``make`` in megatron/core/datasets to build the dataset index
    helpers and exits when that fails. A megatron-core *wheel* ships them prebuilt (helpers_cpp) but
    no Makefile, so that step always fails: skip it when the prebuilt module imports. Returns True if
    the step was replaced."""
    import importlib.util

    try:
        from megatron.core.datasets import utils
    except ImportError:
        return False
    src = os.path.dirname(os.path.abspath(utils.__file__))
    if os.path.isfile(os.path.join(src, "Makefile")):
        return False  # a source checkout: let Megatron build them as usual
    if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is None:
        return False  # nothing to fall back on: Megatron reports the failure itself

    def compile_helpers() -> None:
        print("> megatron_mok.launch: dataset index helpers are prebuilt in this megatron-core wheel (helpers_cpp)")

    utils.compile_helpers = compile_helpers
    return True


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if argv else 2)
    script, rest = argv[0], argv[1:]
    if not os.path.isfile(script):
        raise SystemExit(f"mok-pretrain-gpt: training script not found: {script}")
    _py311_compat()
    import megatron_mok

    megatron_mok.register()
    _prebuilt_dataset_helpers()
    sys.argv = [script, *rest]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
