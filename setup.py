"""Packaging hooks: ship csrc/ inside the package, and build the CUDA extension where we can.

The extension (megatron_mok/kernel/build.py) is the kernels compiled by nvcc and the PyTorch operators compiled
against this torch, linked into one library in the build cache. ``pip install`` builds it when CUDA torch, nvcc and
the CUTLASS headers are all present (set MOK_BUILD_KERNEL=0 to skip, =1 to make a failed build an install error);
otherwise the package installs without it and builds it on first use, or runs the PyTorch reference.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.develop import develop

ROOT = Path(__file__).resolve().parent


def _maybe_build_kernel(package_root: Path) -> None:
    mode = os.environ.get("MOK_BUILD_KERNEL", "auto")
    if mode == "0":
        return
    try:
        import torch

        cuda_torch = torch.version.cuda is not None
    except Exception:  # noqa: BLE001
        cuda_torch = False
    if not cuda_torch and mode != "1":
        print("megatron-mok: CPU-only torch, skipping the CUDA kernel build (reference backend)", file=sys.stderr)
        return
    sys.path.insert(0, str(package_root))
    try:
        from megatron_mok.kernel import build

        if build.find_nvcc() is None or build.cutlass_include() is None:
            raise RuntimeError("nvcc or the CUTLASS headers (pip install --no-deps nvidia-cutlass==4.2.0.0) not found")
        lib = build.build_extension(verbose=True)
        print(f"megatron-mok: built the MoK kernels: {lib}", file=sys.stderr)
    except Exception as exc:  # noqa: BLE001
        if mode == "1":
            raise
        print(f"megatron-mok: kernel not built at install ({exc}); it builds on first use", file=sys.stderr)
    finally:
        sys.path.pop(0)


class BuildPy(build_py):
    def run(self) -> None:
        super().run()
        dest = Path(self.build_lib) / "megatron_mok" / "kernel" / "csrc" / "mok"
        if (ROOT / "csrc" / "mok").is_dir():
            shutil.rmtree(dest, ignore_errors=True)
            shutil.copytree(ROOT / "csrc" / "mok", dest)
        _maybe_build_kernel(Path(self.build_lib))


class Develop(develop):
    def run(self) -> None:
        super().run()
        _maybe_build_kernel(ROOT)


setup(cmdclass={"build_py": BuildPy, "develop": Develop})
