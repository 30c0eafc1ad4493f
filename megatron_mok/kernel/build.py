"""Build of the MoK CUDA extension: the kernels compiled by nvcc, the PyTorch operators (``csrc/mok/apis``) by the host
compiler against this torch, linked into one library that registers the ``mok`` operators' CUDA implementations.

* Sources: ``csrc/mok`` (repo checkout) or the copy shipped inside the package (``megatron_mok/kernel/csrc``).
* Kernels: plain ``nvcc`` (``$MOK_NVCC``, ``$CUDA_HOME/bin/nvcc`` or ``PATH``) with the project's own flags
  (``nvcc_flags``: sm_90a, -O3; torch's extension flags never reach device code), CUTLASS / CuTe headers from the
  ``nvidia-cutlass`` wheel or ``$MOK_CUTLASS_INCLUDE``.
* Operators: the host C++ compiler with torch's include paths and ABI, linked against torch and the CUDA runtime.
* SASS post-pass: the FP8 forward kernel's promotion FMULs get their yield hints interleaved in the compiled object
  before linking (``sass.py``).
* Cache: ``$MOK_CACHE_DIR`` (default ``~/.cache/megatron_mok``), keyed by a hash of the sources, flags, nvcc, torch and
  the post-pass; a finished library is renamed into place atomically, its compiler output kept beside it (``.log``).
* Host compiler: ``/usr/bin/g++`` where ``/opt/gcc`` exists (a wrapper there miscompiled host code).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

from .. import env
from . import sass

_KERNEL = Path(__file__).resolve().parent  # megatron_mok/kernel


class BuildError(RuntimeError):
    pass


@dataclass(frozen=True)
class Extension:
    """One library: its kernel translation units, its operator sources, the target architecture."""

    arch: str
    cuda: tuple[str, ...]
    cpp: tuple[str, ...]


EXTENSIONS = {
    "sm90": Extension(
        "90a", ("host/forward.cu", "host/backward.cu"), ("apis/forward.cpp", "apis/backward.cpp", "apis/units.cpp")
    ),
    "sm100": Extension("100a", ("sm100/mxfp8_grouped_gemm.cu",), ("apis/sm100.cpp",)),
}


def source_dir() -> Path:
    candidates = [_KERNEL.parent.parent / "csrc" / "mok", _KERNEL / "csrc" / "mok"]  # checkout, or the installed copy
    for c in candidates:
        if (c / "host" / "forward.cu").is_file():
            return c
    raise BuildError(f"MoK CUDA sources not found (looked in {', '.join(str(c) for c in candidates)})")


def library_sources(src: Path, which: str = "sm90") -> list[Path]:
    """Every source a library may include (the cache key hashes them all): csrc/mok and its concept folders; the
    sm_100 unit's folder only for its own library."""
    return sorted(
        p
        for p in src.rglob("*")
        if p.suffix in (".cu", ".cuh", ".h", ".cpp")
        and (("sm100" in p.parts) == (which == "sm100") or p.suffix == ".h")
    )


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
    """The build-time switches the kernels are compiled with: only the timing-ablation build (``MOK_DEBUG=ablation``,
    csrc/mok/common.cuh), which the hang-diagnosis and benchmark tools use."""
    return {"MOK_ABLATION": int(env.debug().ablation is not None)}


def _host_compiler() -> str | None:
    if Path("/opt/gcc").exists() and Path("/usr/bin/g++").exists():
        return "/usr/bin/g++"
    return None


def nvcc_release(version: str) -> tuple[int, int]:
    """(major, minor) of an nvcc from its ``--version`` text ("release 13.0"), (0, 0) if it does not say."""
    m = re.search(r"release (\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def nvcc_flags(include: Path, src: Path, arch: str = "90a", release: tuple[int, int] = (0, 0)) -> list[str]:
    """The kernels' nvcc flags; ``release``: the nvcc's (``nvcc_release``), for the options older ones lack."""
    flags = [
        f"-gencode=arch=compute_{arch},code=sm_{arch}",
        "-std=c++17",
        "-O3",
        "--expt-relaxed-constexpr",
        "-Xcompiler",
        "-fPIC",
        f"-I{include}",
        f"-I{src}",
    ]
    if arch == "100a":  # CUTLASS's host utilities (the sm_100 unit's collective builder), shipped in the same wheel
        flags.append(f"-I{include.parent / 'tools' / 'util' / 'include'}")
    if build_choices()["MOK_ABLATION"]:  # timing-ablation variant (see csrc/mok/common.cuh)
        flags.append("-DMOK_ABLATION")
    if release >= (12, 4):  # uncompressed fat binaries: the SASS post-pass (sass.py) reads the objects' cubins
        flags.append("--compress-mode=none")
    if _host_compiler():
        flags += ["-ccbin", _host_compiler()]
    return flags


def _cuda_home() -> Path:
    """The CUDA toolkit the kernels are compiled with: nvcc's installation (headers, libcudart)."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise BuildError("nvcc not found (set MOK_NVCC or CUDA_HOME)")
    return Path(os.path.realpath(nvcc)).parent.parent


def torch_flags() -> tuple[list[str], list[str]]:
    """(compile flags, link flags) of a torch C++ operator library with CUDA: torch's headers, ABI and libraries, and
    the CUDA toolkit's runtime."""
    import torch
    from torch.utils import cpp_extension

    cuda = _cuda_home()
    inc = [*cpp_extension.include_paths(), str(cuda / "include")]
    cflags = [
        "-std=c++17",
        "-O2",
        "-fPIC",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        *(f"-isystem{p}" for p in inc),
    ]
    torch_lib = cpp_extension.library_paths()
    ldflags = [
        "-shared",
        *(f"-L{p}" for p in [*torch_lib, str(cuda / "lib64")]),
        *(f"-Wl,-rpath,{p}" for p in torch_lib),
        "-lc10",
        "-ltorch",
        "-ltorch_cpu",
        "-lc10_cuda",
        "-ltorch_cuda",
        "-lcudart",
    ]
    return cflags, ldflags


def _nvcc_version(nvcc: str) -> str:
    try:
        return subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    except Exception as exc:  # pragma: no cover - reported by callers
        raise BuildError(f"cannot run {nvcc}: {exc}") from exc


def _check_tools() -> tuple[str, Path, Path]:
    nvcc = find_nvcc()
    if nvcc is None:
        raise BuildError("nvcc not found (set MOK_NVCC or CUDA_HOME)")
    inc = cutlass_include()
    if inc is None:
        raise BuildError("CUTLASS/CuTe headers not found: pip install --no-deps nvidia-cutlass==4.2.0.0")
    return nvcc, inc, source_dir()


def cache_dir() -> Path:
    return env.cache_dir()


def _run_all(cmds: list[list[str]], verbose: bool) -> str:
    """Run compiler commands in parallel; their output, or BuildError naming the first that failed."""
    if verbose:
        for cmd in cmds:
            print("[mok build]", " ".join(cmd), flush=True)
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for cmd in cmds]
    logs = []
    failed = None
    for cmd, proc in zip(cmds, procs):
        out, _ = proc.communicate()
        logs.append(" ".join(cmd) + "\n" + out)
        if proc.returncode != 0 and failed is None:
            failed = f"{cmd[0]} failed ({proc.returncode}):\n{' '.join(cmd)}\n{out[-8000:]}"
    if failed:
        raise BuildError(failed)
    text = "\n".join(logs)
    if verbose and text.strip():
        print(text, flush=True)
    return text


def build_extension(which: str = "sm90", verbose: bool = False, force: bool = False) -> Path:
    """Build (or reuse from the cache) the operator library ``which`` (``EXTENSIONS``); returns its path."""
    import torch

    ext = EXTENSIONS[which]
    nvcc, inc, src = _check_tools()
    version = _nvcc_version(nvcc)
    flags = [*nvcc_flags(inc, src, ext.arch, nvcc_release(version)), "-Xptxas", "-v"]
    cflags, ldflags = torch_flags()
    cxx = _host_compiler() or "c++"
    h = hashlib.sha256()
    for f in library_sources(src, which):
        h.update(str(f.relative_to(src)).encode())
        h.update(f.read_bytes())
    for part in (flags, cflags, ldflags, [cxx, torch.__version__, version]):
        h.update(" ".join(part).encode())
    for tool in (Path(__file__), Path(sass.__file__)):  # this build procedure and its post-pass
        h.update(tool.read_bytes())
    key = h.hexdigest()[:20]
    out_dir = cache_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / f"mok_{which}-{key}.so"
    if lib.exists() and not force:
        return lib
    work = Path(tempfile.mkdtemp(prefix=f"mok_{which}_", dir=out_dir))
    try:
        objs = [work / (Path(s).stem + ("_cu.o" if s.endswith(".cu") else ".o")) for s in (*ext.cuda, *ext.cpp)]
        cmds = [[nvcc, *flags, "-c", "-o", str(o), str(src / s)] for s, o in zip(ext.cuda, objs)]
        cmds += [
            [cxx, *cflags, f"-I{src}", "-c", "-o", str(o), str(src / s)] for s, o in zip(ext.cpp, objs[len(ext.cuda) :])
        ]
        log = _run_all(cmds, verbose)
        for source, obj in zip(ext.cuda, objs):
            log += _post_pass(source, obj)
        tmp = work / lib.name
        log += _run_all([[cxx, *map(str, objs), *ldflags, "-o", str(tmp)]], verbose)
        (out_dir / f"mok_{which}-{key}.log").write_text(log)
        os.replace(tmp, lib)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return lib


def _post_pass(source: str, obj: Path) -> str:
    """The SASS post-pass of one freshly compiled kernel translation unit (the FP8 forward's promotion yield hints, in
    host/forward.cu only); its line for the build log. A forward object without the runs is linked as compiled, with a
    warning: the FP8 forward then runs ~3 % slower."""
    if os.path.normpath(source) != os.path.normpath("host/forward.cu"):
        return ""
    runs = sass.interleave_yield(obj)
    if not runs:
        msg = f"sass post-pass: no FP8 promotion FMUL runs in {obj.name}; linked as compiled (FP8 forward ~3 % slower)"
        warnings.warn(f"MoK build: {msg}", stacklevel=2)
        return f"\n{msg}\n"
    fmuls = sum(r.length for r in runs)
    return f"\nsass post-pass: yield hints interleaved in {len(runs)} FP8 promotion runs of {source} ({fmuls} FMULs)\n"


def build_log(which: str = "sm90") -> str:
    """The compiler output of the cached library ``which`` (built first if needed): ptxas's reports included."""
    return build_extension(which).with_suffix(".log").read_text()


def compile_only(
    output: Path | None = None,
    verbose: bool = False,
    source: str = "host/forward.cu",
    post_pass: bool = True,
    object_file: bool = False,
) -> Path:
    """Compile one kernel translation unit into a cubin with the library's flags (no GPU, no torch, nothing loaded):
    the CPU compile check and the SASS a refactor is compared on, with the library's SASS post-pass unless
    ``post_pass`` is False; with ``object_file`` the object the library links instead (``-c``). ptxas's report is
    written beside it (``.log``). Returns its path."""
    nvcc, inc, src = _check_tools()
    arch = "100a" if source.startswith("sm100/") else "90a"
    suffix = ".o" if object_file else ".cubin"
    out = Path(output) if output else Path(tempfile.mkdtemp(prefix="mok_cc_")) / (Path(source).stem + suffix)
    flags = nvcc_flags(inc, src, arch, nvcc_release(_nvcc_version(nvcc)))
    mode = "-c" if object_file else "-cubin"
    log = _run_all([[nvcc, *flags, mode, "-Xptxas", "-v", "-o", str(out), str(src / source)]], verbose)
    if post_pass:
        log += _post_pass(source, out)
    out.with_suffix(".log").write_text(log)
    return out


def compile_operators(verbose: bool = False) -> list[Path]:
    """Compile the operator sources of every library (no link, no GPU): the CPU check that they match this torch's
    headers and the launch arguments. Returns the object files."""
    _, _, src = _check_tools()
    cflags, _ = torch_flags()
    cxx = _host_compiler() or "c++"
    out = Path(tempfile.mkdtemp(prefix="mok_ops_"))
    sources = [s for ext in EXTENSIONS.values() for s in ext.cpp]
    objs = [out / (Path(s).stem + ".o") for s in sources]
    _run_all([[cxx, *cflags, f"-I{src}", "-c", "-o", str(o), str(src / s)] for s, o in zip(sources, objs)], verbose)
    return objs


if __name__ == "__main__":  # python -m megatron_mok.kernel.build [sm90|sm100]: build ahead of use
    print(build_extension(sys.argv[1] if len(sys.argv) > 1 else "sm90", verbose=True))
