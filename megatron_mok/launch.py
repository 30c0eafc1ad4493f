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
    sys.argv = [script, *rest]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
