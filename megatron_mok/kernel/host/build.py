"""JIT build of the MoK CUDA library (torch-independent shared object, loaded with ctypes).

* Sources: ``csrc/mok/*.cu[h]`` (repo checkout) or the copy shipped inside the package
  (``megatron_mok/kernel/csrc``), whichever exists.
* Compiler: plain ``nvcc`` (``$MOK_NVCC``, ``$CUDA_HOME/bin/nvcc`` or ``PATH``) with
  ``-gencode=arch=compute_90a,code=sm_90a``; CUTLASS/CuTe headers from the ``nvidia-cutlass`` wheel
  (``cutlass_library/source/include``) or ``$MOK_CUTLASS_INCLUDE``.
* Cache: ``$MOK_CACHE_DIR`` (default ``~/.cache/megatron_mok``), keyed by a hash of sources, flags and
  the nvcc version; a finished build is renamed into place atomically.
* Host compiler: if ``/opt/gcc`` exists (device image) we force ``/usr/bin/g++`` as host compiler
  (the /opt/gcc wrapper miscompiled host code there, see notes/kernels.md).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from ... import env

_KERNEL = Path(__file__).resolve().parent.parent  # megatron_mok/kernel
LIB_NAME = "libmok_forward"
MAIN_SOURCE = "host/forward.cu"


class BuildError(RuntimeError):
    pass


def source_dir() -> Path:
    candidates = [_KERNEL.parent.parent / "csrc" / "mok", _KERNEL / "csrc" / "mok"]  # checkout, or the installed copy
    for c in candidates:
        if (c / MAIN_SOURCE).is_file():
            return c
    raise BuildError(f"MoK CUDA sources not found (looked in {', '.join(str(c) for c in candidates)})")


def library_sources(src: Path) -> list[Path]:
    """Every source a library may include (the cache key hashes them all): csrc/mok and its concept folders, the
    sm_100 units aside."""
    return sorted(p for p in src.rglob("*") if p.suffix in (".cu", ".cuh", ".h") and "sm100" not in p.parts)


def find_nvcc() -> str | None:
    explicit = env.nvcc()
    if explicit:
        return explicit if Path(explicit).exists() else None
    for home in (env.cuda_home(), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").exists():
            return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def cutlass_include() -> Path | None:
    explicit = env.cutlass_include()
    if explicit:
        return Path(explicit) if (Path(explicit) / "cute").is_dir() else None
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        return None
    inc = Path(list(spec.submodule_search_locations)[0]) / "source" / "include"
    return inc if (inc / "cute" / "arch" / "mma_sm90_gmma.hpp").is_file() else None


def build_choices() -> dict[str, int]:
    """The build-time switches the library is compiled with: only the timing-ablation build (``MOK_DEBUG=ablation``,
    csrc/mok/common.cuh), which the hang-diagnosis and benchmark tools use."""
    return {"MOK_ABLATION": int(env.debug().ablation is not None)}


def nvcc_flags(include: Path, src: Path) -> list[str]:
    flags = [
        "-gencode=arch=compute_90a,code=sm_90a",
        "-std=c++17",
        "-O3",
        "--expt-relaxed-constexpr",
        "-Xcompiler",
        "-fPIC",
        f"-I{include}",
        f"-I{src}",
    ]
    if build_choices()["MOK_ABLATION"]:  # timing-ablation variant (see csrc/mok/common.cuh)
        flags.append("-DMOK_ABLATION")
    if Path("/opt/gcc").exists() and Path("/usr/bin/g++").exists():
        flags += ["-ccbin", "/usr/bin/g++"]
    return flags


def _nvcc_version(nvcc: str) -> str:
    try:
        return subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    except Exception as exc:  # pragma: no cover - reported by callers
        raise BuildError(f"cannot run {nvcc}: {exc}") from exc


def _cache_key(src: Path, flags: list[str], nvcc_ver: str) -> str:
    h = hashlib.sha256()
    for f in library_sources(src):
        h.update(str(f.relative_to(src)).encode())
        h.update(f.read_bytes())
    h.update(" ".join(flags).encode())
    h.update(nvcc_ver.encode())
    return h.hexdigest()[:20]


def cache_dir() -> Path:
    return env.cache_dir()


def _check_tools() -> tuple[str, Path, Path]:
    nvcc = find_nvcc()
    if nvcc is None:
        raise BuildError("nvcc not found (set MOK_NVCC or CUDA_HOME)")
    inc = cutlass_include()
    if inc is None:
        raise BuildError("CUTLASS/CuTe headers not found: pip install --no-deps nvidia-cutlass==4.2.0.0")
    return nvcc, inc, source_dir()


def compile_only(output: Path | None = None, verbose: bool = False, extra_flags: list[str] | None = None) -> Path:
    """Compile the kernel for sm_90a into a cubin (no GPU, no load). Returns the output path."""
    nvcc, inc, src = _check_tools()
    out = Path(output) if output else Path(tempfile.mkdtemp(prefix="mok_cc_")) / f"{LIB_NAME}.cubin"
    cmd = [nvcc, *nvcc_flags(inc, src), "-cubin", *(extra_flags or []), "-o", str(out), str(src / MAIN_SOURCE)]
    _run(cmd, verbose)
    return out


def cached_library(name: str, key: str, nvcc: str, flags: list[str], source: Path, verbose: bool, force: bool) -> Path:
    """``$MOK_CACHE_DIR/<name>-<key>.so`` built from ``source`` unless it exists (or ``force``): compiled
    under a per-process temporary name and renamed into place, the compiler output kept beside it (.log).
    Every MoK library (forward, backward, sm_100 units) is built through here."""
    out_dir = cache_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / f"{name}-{key}.so"
    if lib.exists() and not force:
        return lib
    tmp = out_dir / f".{name}-{key}-{os.getpid()}.so"
    cmd = [nvcc, *flags, "-o", str(tmp), str(source)]
    log = _run(cmd, verbose)
    (out_dir / f"{name}-{key}.log").write_text(" ".join(cmd) + "\n" + log)
    os.replace(tmp, lib)
    return lib


def build_library(verbose: bool = False, force: bool = False) -> Path:
    """Build (or reuse from cache) the shared library; returns its path."""
    nvcc, inc, src = _check_tools()
    flags = nvcc_flags(inc, src) + ["-shared", "-Xptxas", "-v"]
    key = _cache_key(src, flags, _nvcc_version(nvcc))
    return cached_library(LIB_NAME, key, nvcc, flags, src / MAIN_SOURCE, verbose, force)


# ---- Blackwell (sm_100a) units: compiled here, runnable only on a Blackwell GPU ----------------------
SM100_LIB_NAME = "libmok_sm100"
SM100_SOURCE = "sm100/mxfp8_grouped_gemm.cu"


def sm100_flags(include: Path, src: Path) -> list[str]:
    """nvcc flags of the sm_100a units: the sm_90a flags with the Blackwell target and CUTLASS's host
    utilities (``tools/util/include``, shipped in the same wheel)."""
    flags = [f for f in nvcc_flags(include, src) if not f.startswith("-gencode=")]
    util = include.parent / "tools" / "util" / "include"
    return ["-gencode=arch=compute_100a,code=sm_100a", *flags, f"-I{util}"]


def compile_sm100(output: Path | None = None, verbose: bool = False) -> Path:
    """Compile the MXFP8 grouped expert GEMM unit for sm_100a into a cubin (no GPU needed): the
    Blackwell path's compile check. Returns the cubin path."""
    nvcc, inc, src = _check_tools()
    out = Path(output) if output else Path(tempfile.mkdtemp(prefix="mok_sm100_")) / f"{SM100_LIB_NAME}.cubin"
    _run([nvcc, *sm100_flags(inc, src), "-cubin", "-Xptxas", "-v", "-o", str(out), str(src / SM100_SOURCE)], verbose)
    return out


def build_sm100_library(verbose: bool = False, force: bool = False) -> Path:
    """Build (or reuse from cache) the sm_100a shared library of the Blackwell units."""
    nvcc, inc, src = _check_tools()
    flags = sm100_flags(inc, src) + ["-shared"]
    h = hashlib.sha256()
    for f in (SM100_SOURCE, "host/host_launch.h", "host/param_upload.cuh"):  # the unit and the host helpers it includes
        h.update((src / f).read_bytes())
    h.update(" ".join(flags).encode())
    h.update(_nvcc_version(nvcc).encode())
    return cached_library(SM100_LIB_NAME, h.hexdigest()[:20], nvcc, flags, src / SM100_SOURCE, verbose, force)


def _run(cmd: list[str], verbose: bool) -> str:
    if verbose:
        print("[mok build]", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    text = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise BuildError(f"nvcc failed ({proc.returncode}):\n{' '.join(cmd)}\n{text[-8000:]}")
    if verbose and text.strip():
        print(text, flush=True)
    return text
