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
    """The forward kernel's tuning (config key ``kernel.tile_raster``): the GEMM ticket order (None: the kernel's
    measured default per dtype; changes no result bit)."""

    tile_raster: int | None = None

    def __post_init__(self) -> None:
        if self.tile_raster is not None and not (type(self.tile_raster) is int and 0 <= self.tile_raster <= 64):
            raise ValueError(f"kernel.tile_raster must be None or an integer in [0, 64], got {self.tile_raster!r}")

    @staticmethod
    def debug_bits() -> int:
        """The timing-ablation bits of ``MOK_DEBUG=ablation=BITS`` (read by the ablation build only), else 0."""
        return env.debug().ablation or 0
