"""What a launch is told besides its tensors: the forward kernel's tuning (config keys) and the SwiGLU variant."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .. import env
from ..activation import Glu


def glu_args(glu: Glu | None) -> tuple[int, float, float]:
    """The operators' (glu, glu_clamp, glu_offset) of a SwiGLU variant (csrc/mok/gemm/swiglu.cuh): (0, inf, 0) for
    None or the plain SwiGLU (the kernels' plain instances), else 1 with the clamp (+inf: none) and the offset."""
    if glu is None or glu.plain:
        return 0, math.inf, 0.0
    return 1, math.inf if glu.clamp is None else float(glu.clamp), float(glu.offset)


@dataclass(frozen=True)
class ForwardTuning:
    """The forward kernel's tuning (config keys ``kernel.tile_raster`` / ``macrobatches`` / ``fast_silu``): the
    GEMM ticket order (None: the kernel's measured default per dtype), token chunks (EP 1; same results) and,
    for FP8, the tanh.approx SiLU of the fc1 epilogue (moves a few e4m3 roundings)."""

    tile_raster: int | None = None
    macrobatches: int = 1
    fast_silu: bool = False

    def __post_init__(self) -> None:
        if self.tile_raster is not None and not (type(self.tile_raster) is int and 0 <= self.tile_raster <= 64):
            raise ValueError(f"kernel.tile_raster must be None or an integer in [0, 64], got {self.tile_raster!r}")
        if not (type(self.macrobatches) is int and 1 <= self.macrobatches <= 64):
            raise ValueError(f"kernel.macrobatches must be an integer in [1, 64], got {self.macrobatches!r}")
        if type(self.fast_silu) is not bool:
            raise ValueError(f"kernel.fast_silu must be True or False, got {self.fast_silu!r}")

    @staticmethod
    def debug_bits() -> int:
        """The timing-ablation bits of ``MOK_DEBUG=ablation=BITS`` (read by the ablation build only), else 0."""
        return env.debug().ablation or 0
