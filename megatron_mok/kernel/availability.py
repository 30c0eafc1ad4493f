"""Can a MoK kernel run here? One cached probe per kernel library (never raises)."""

from __future__ import annotations

from collections.abc import Callable


class KernelAvailability:
    def __init__(self, what: str, load_library: Callable[[], object]) -> None:
        self.what = what
        self.load_library = load_library
        self._avail: bool | None = None
        self._reason = "not checked yet"

    def _probe(self) -> tuple[bool, str]:
        try:
            import torch
        except Exception as exc:  # pragma: no cover
            return False, f"torch import failed: {exc}"
        if not torch.cuda.is_available():
            return False, "no CUDA device (torch.cuda.is_available() is False)"
        try:
            major, minor = torch.cuda.get_device_capability()
        except Exception as exc:
            return False, f"cannot query the CUDA device: {exc}"
        if (major, minor) != (9, 0):
            return False, f"the {self.what} needs an sm_90 (Hopper) GPU, found sm_{major}{minor}"
        try:
            self.load_library()
        except Exception as exc:
            return False, f"building/loading the {self.what} library failed: {exc}"
        return True, "available"

    def is_available(self) -> bool:
        if self._avail is None:
            try:
                self._avail, self._reason = self._probe()
            except Exception as exc:  # never raise
                self._avail, self._reason = False, f"unexpected error: {exc}"
        return self._avail

    def unavailable_reason(self) -> str:
        return "" if self.is_available() else self._reason
