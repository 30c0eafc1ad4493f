"""Every environment variable megatron-mok reads, and the only module that reads them.

Settings that change what or how fast the layer computes live in the YAML config (``megatron_mok/configs``,
validated by :mod:`megatron_mok.config`); the environment chooses only the backend, the config, paths of the
build, the NVLink fabric override and a debug switch. The CUDA sources read none.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

#: name -> what it does (README, "Environment")
VARIABLES: dict[str, str] = {
    "MOK_BACKEND": "auto (default: the kernel where it can run, else the PyTorch reference), kernel or reference",
    "MOK_CONFIG": "the MoK config, a bundled name or a YAML path (default: --mok-config, else the model's)",
    "MOK_CACHE_DIR": "where built kernel libraries are cached (default ~/.cache/megatron_mok)",
    "MOK_NVCC": "the nvcc to build the kernels with (default $CUDA_HOME/bin/nvcc, /usr/local/cuda, PATH)",
    "CUDA_HOME": "the CUDA toolkit whose nvcc builds the kernels",
    "MOK_CUTLASS_INCLUDE": "CUTLASS / CuTe headers (default: the nvidia-cutlass wheel's)",
    "MOK_NVLINK_FABRIC": "the NVLink fabric id of this GPU, where NVML cannot tell (EP beyond one host)",
    "MOK_DEBUG": "comma-separated: sync (synchronise after every launch, raise at once), ablation[=BITS] (the "
    "timing-ablation build, leaving out the stages of BITS: csrc/mok/common.cuh; results wrong)",
}


class MokEnvError(ValueError):
    """An environment variable of megatron-mok has a value it does not accept."""


def _get(name: str) -> str | None:
    assert name in VARIABLES, name
    v = os.environ.get(name)
    return v if v not in (None, "") else None


def backend() -> str:
    value = (_get("MOK_BACKEND") or "auto").strip().lower()
    if value not in ("auto", "reference", "kernel"):
        raise MokEnvError(f"MOK_BACKEND={value!r} is not one of auto, reference, kernel")
    return value


def config_name() -> str | None:
    return _get("MOK_CONFIG")


def cache_dir() -> Path:
    v = _get("MOK_CACHE_DIR")
    return Path(v) if v else Path.home() / ".cache" / "megatron_mok"


def nvcc() -> str | None:
    return _get("MOK_NVCC")


def cuda_home() -> str | None:
    return _get("CUDA_HOME")


def cutlass_include() -> str | None:
    return _get("MOK_CUTLASS_INCLUDE")


def nvlink_fabric() -> str | None:
    return _get("MOK_NVLINK_FABRIC")


@dataclass(frozen=True)
class Debug:
    sync: bool = False
    #: None: the normal build; else the timing-ablation build with these leave-one-stage-out bits
    ablation: int | None = None


def debug() -> Debug:
    v = _get("MOK_DEBUG")
    if v is None:
        return Debug()
    sync, ablation = False, None
    for word in (w.strip() for w in v.split(",") if w.strip()):
        key, _, bits = word.partition("=")
        if key == "sync" and not bits:
            sync = True
        elif key == "ablation":
            try:
                ablation = int(bits, 0) if bits else 0
            except ValueError:
                ablation = -1
            if ablation < 0:
                raise MokEnvError(f"MOK_DEBUG: ablation bits must be a non-negative integer, got {bits!r}")
        else:
            raise MokEnvError(f"MOK_DEBUG={v!r}: unknown word {word!r} (sync, ablation[=BITS])")
    return Debug(sync=sync, ablation=ablation)
