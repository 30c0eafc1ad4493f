"""A post-pass over the FP8 forward kernel's machine code: the yield hint flipped on every other FMUL of its scale
promotion.

Each 128-wide K block of the FP8 K loop (``csrc/mok/gemm/fp8_kloop.cuh``) drains its WGMMA group and rescales the
accumulator in place, on the path from one block's drain to the next block's issue: in each FP8 forward instance a
run of 128 FMULs inside the loop (and one of 123, the final rescale after it, with nvcc 13.0), issued back to back
(stall 1) with one yield hint on all but a run's last. Flipping the hint on every other FMUL of a run (the second of
each pair, the last one included) and clearing those instructions' operand-reuse flags (a warp switch after one of
them would leave the reuse cache to another warp) made the FP8 forward 3 % faster on an H100 with identical output
bits (docs/design.md). ptxas has no switch for it, so the build patches the freshly compiled object
before linking, once (the flip is its own inverse), as DeepGEMM once interleaved its promotion FFMAs.

Encoding (sm_90, 128-bit instructions, two little-endian 64-bit words): the opcode in bits 0-11 of the low word
(0x220: FMUL with register operands), the yield hint at bit 45 and the four operand-reuse flags at bits 58-61 of the
high word. Only sm_90 CUDA images, and in them only runs of at least ``MIN_RUN`` consecutive FMULs in the FP8 forward
kernels' own sections, are touched: nothing else in the kernels has such runs (the next longest: 20), and every other
kernel is left as compiled. The objects must embed their cubins uncompressed (the build passes
``--compress-mode=none`` where nvcc knows it, 12.4 and later)."""

from __future__ import annotations

import itertools
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

FMUL_OPCODE = 0x220
YIELD_HINT = 1 << 45
REUSE_FLAGS = 0xF << 58
MIN_RUN = 100
#: the FP8 instantiations of ``mok::mok_forward_kernel<bool kFp8, int>`` (mangled prefix of their section names)
FP8_FORWARD_KERNEL = "_ZN3mok18mok_forward_kernelILb1E"
_EM_CUDA = 190
_SM = 90  # the architecture these encodings are for (bits 8-15 of a cubin's e_flags)
_INSTR = 16


@dataclass(frozen=True)
class FmulRun:
    """One run of consecutive FMULs: its function and the file offset of its first instruction."""

    function: str
    offset: int
    length: int


def cuda_elfs(blob: bytes) -> Iterator[dict[str, tuple[int, int]]]:
    """The sm_90 CUDA ELF images in a file (a cubin, or an object or library that embeds them uncompressed): each
    one's sections {name: (file offset, size)}, every section within the file."""
    i = blob.find(b"\x7fELF\x02\x01")
    while i >= 0:
        try:
            (machine,) = struct.unpack_from("<H", blob, i + 18)
            (e_flags,) = struct.unpack_from("<I", blob, i + 48)
            if machine == _EM_CUDA and (e_flags >> 8) & 0xFF == _SM:
                (shoff,) = struct.unpack_from("<Q", blob, i + 40)
                shentsize, shnum, shstrndx = struct.unpack_from("<HHH", blob, i + 58)
                headers = [struct.unpack_from("<IIQQQQ", blob, i + shoff + k * shentsize) for k in range(shnum)]
                names_at = i + headers[shstrndx][4]
                sections = {}
                for name_off, _type, _flags, _addr, offset, size in headers:
                    start = names_at + name_off
                    name = blob[start : blob.index(b"\0", start)].decode()
                    if i + offset + size <= len(blob):
                        sections[name] = (i + offset, size)
                yield sections
        except (struct.error, IndexError, ValueError, UnicodeDecodeError):
            pass  # bytes that only look like an ELF header
        i = blob.find(b"\x7fELF\x02\x01", i + 4)


def promotion_runs(blob: bytes) -> list[FmulRun]:
    """The FMUL runs of at least ``MIN_RUN`` instructions in the FP8 forward kernels of every CUDA image in blob."""

    def is_fmul(at: int) -> bool:
        return struct.unpack_from("<Q", blob, at)[0] & 0xFFF == FMUL_OPCODE

    runs = []
    for sections in cuda_elfs(blob):
        for name, (offset, size) in sections.items():
            if not name.startswith(".text." + FP8_FORWARD_KERNEL):
                continue
            for fmul, group in itertools.groupby(range(offset, offset + size - _INSTR + 1, _INSTR), key=is_fmul):
                at = list(group)
                if fmul and len(at) >= MIN_RUN:
                    runs.append(FmulRun(name[len(".text.") :], at[0], len(at)))
    return runs


def interleave_yield(path: Path) -> list[FmulRun]:
    """Flip the yield hint (and clear the reuse flags) of every other FMUL, the second of each pair, of each promotion
    run in the file at ``path``, in place. Returns the runs (none: nothing changed, e.g. a compressed fat binary)."""
    blob = bytearray(Path(path).read_bytes())
    runs = promotion_runs(bytes(blob))
    for run in runs:
        for k in range(1, run.length, 2):
            at = run.offset + k * _INSTR + 8
            (high,) = struct.unpack_from("<Q", blob, at)
            struct.pack_into("<Q", blob, at, (high ^ YIELD_HINT) & ~REUSE_FLAGS)
    if runs:
        Path(path).write_bytes(bytes(blob))
    return runs
