"""The SASS post-pass (``megatron_mok.kernel.sass``) on a synthetic CUDA ELF embedded in a larger file, as a compiled
object embeds its cubin: which runs it finds, which bits it changes, and what it leaves alone. (The real kernel's
runs: tests/gpu/test_kernel_compiles.py, where nvcc is available.)"""

from __future__ import annotations

import struct
from pathlib import Path

from megatron_mok.kernel import sass

FP8 = sass.FP8_FORWARD_KERNEL + "Li0EEEvNS_6ParamsE"
BF16 = "_ZN3mok18mok_forward_kernelILb0ELi0EEEvNS_6ParamsE"
HIGH = 0x044FE20000400000  # an FMUL's high word as ptxas writes it: stall 1, yield bit set, reuse on operand a
FMUL = (0x000000B118B17220, HIGH | (1 << 58))
OTHER = (0x000000B118B17223, HIGH)  # FFMA: not an FMUL


def _elf(sections: dict[str, list[tuple[int, int]]], sm: int = 90) -> bytes:
    """A minimal 64-bit little-endian CUDA ELF for sm_``sm`` with one section per entry (name -> instructions as
    (low, high))."""
    names = b"\0.shstrtab\0" + b"".join(f".text.{n}\0".encode() for n in sections)
    bodies = [b"".join(struct.pack("<QQ", lo, hi) for lo, hi in ins) for ins in sections.values()]
    data_at = 64
    offsets, body = [], b""
    for b in bodies:
        offsets.append(data_at + len(body))
        body += b
    strtab_at = data_at + len(body)
    shoff = strtab_at + len(names)
    shoff += -shoff % 8
    headers = [struct.pack("<IIQQQQIIQQ", 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)]
    headers.append(struct.pack("<IIQQQQIIQQ", 1, 3, 0, 0, strtab_at, len(names), 0, 0, 1, 0))
    name_at = len(b"\0.shstrtab\0")
    for n, at, b in zip(sections, offsets, bodies):
        headers.append(struct.pack("<IIQQQQIIQQ", name_at, 1, 6, 0, at, len(b), 0, 0, 128, 0))
        name_at += len(f".text.{n}\0")
    ident = b"\x7fELF\x02\x01\x01" + b"\0" * 9
    head = ident + struct.pack("<HHIQQQIHHHHHH", 2, 190, 1, 0, 0, shoff, sm << 8, 64, 0, 0, 64, len(headers), 1)
    blob = head + body + names
    return blob + b"\0" * (shoff - len(blob)) + b"".join(headers)


def _file(tmp_path: Path, sections, sm: int = 90) -> tuple[Path, bytes, int]:
    """An "object": host bytes, then the CUDA ELF; returns its path, its bytes and the ELF's offset."""
    prefix = b"\x7fELF\x02\x01\x01" + b"\0" * 9 + struct.pack("<H", 62) + b"host code" * 50  # an x86-64 ELF header
    prefix += b"\0" * (-len(prefix) % 16)  # sections stay 16-byte aligned in the file, as in a real object
    blob = prefix + _elf(sections, sm)
    path = tmp_path / "forward_cu.o"
    path.write_bytes(blob)
    return path, blob, len(prefix)


def test_finds_the_fp8_kernels_long_fmul_runs_only(tmp_path):
    fp8 = [OTHER] * 3 + [FMUL] * 128 + [OTHER] + [FMUL] * 99 + [OTHER] + [FMUL] * 101
    path, blob, _ = _file(tmp_path, {FP8: fp8, BF16: [FMUL] * 200})
    runs = sass.promotion_runs(blob)
    assert [(r.function, r.length) for r in runs] == [(FP8, 128), (FP8, 101)]  # not the 99, not the bf16 kernel
    first = runs[0].offset
    assert struct.unpack_from("<Q", blob, first)[0] == FMUL[0]
    assert struct.unpack_from("<Q", blob, first - 16)[0] == OTHER[0]


def test_flips_the_yield_hint_and_clears_reuse_on_every_other_fmul(tmp_path):
    fp8 = [OTHER] * 2 + [FMUL] * 120 + [OTHER] * 2
    path, before, _ = _file(tmp_path, {FP8: fp8, BF16: [FMUL] * 120})
    runs = sass.interleave_yield(path)
    after = path.read_bytes()
    assert len(after) == len(before) and len(runs) == 1
    changed = [i for i in range(0, len(before), 8) if before[i : i + 8] != after[i : i + 8]]
    run = runs[0]
    assert changed == [run.offset + 16 * k + 8 for k in range(1, 120, 2)]  # high words of the second of each pair
    for at in changed:
        (old,) = struct.unpack_from("<Q", before, at)
        (new,) = struct.unpack_from("<Q", after, at)
        assert new == (old ^ sass.YIELD_HINT) & ~sass.REUSE_FLAGS
        assert new & sass.REUSE_FLAGS == 0 and (new ^ old) & sass.YIELD_HINT


def test_leaves_a_file_without_runs_untouched(tmp_path):
    path, before, _ = _file(tmp_path, {BF16: [FMUL] * 300, FP8: [OTHER] * 10})
    assert sass.interleave_yield(path) == []
    assert path.read_bytes() == before
    junk = tmp_path / "junk.o"
    junk.write_bytes(b"\x7fELF\x02\x01\x01" + b"\xff" * 60 + b"\x7fELF\x02\x01")  # truncated headers: no image
    assert sass.interleave_yield(junk) == []


def test_leaves_other_architectures_and_cut_files_alone(tmp_path):
    path, before, _ = _file(tmp_path, {FP8: [FMUL] * 120}, sm=100)  # the encodings are sm_90's
    assert sass.interleave_yield(path) == [] and path.read_bytes() == before
    path, before, at = _file(tmp_path, {FP8: [FMUL] * 120})
    (shoff,) = struct.unpack_from("<Q", before, at + 40)
    bad = bytearray(before)
    struct.pack_into("<Q", bad, at + shoff + 2 * 64 + 32, 10**6)  # the FP8 section claims more bytes than the file
    path.write_bytes(bytes(bad))
    assert sass.interleave_yield(path) == [] and path.read_bytes() == bytes(bad)


def test_a_second_pass_undoes_the_first(tmp_path):
    """The flip is its own inverse: the build applies it once, to a freshly compiled object."""
    path, before, _ = _file(tmp_path, {FP8: [FMUL] * 110})
    sass.interleave_yield(path)
    sass.interleave_yield(path)
    after = path.read_bytes()
    reuse = [at for at in range(0, len(before), 16) if before[at + 8 : at + 16] != after[at + 8 : at + 16]]
    assert len(reuse) == 55  # the yields are back; the cleared reuse flags stay cleared
