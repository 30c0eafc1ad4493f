"""MXFP8 (OCP microscaling, e4m3 elements): the Blackwell (sm_100a) numerics of ``kernel.dtype: mxfp8``,
and the oracle of the MXFP8 quantiser (``csrc/mok/quant/mxfp8_quant.cuh``, arch-neutral: tested on the H200)
and of the sm_100a block-scaled expert GEMM unit (``csrc/mok/sm100/``, compiled here, not runnable).

* every 1 x 32 block along K (the reduction dimension) shares one UE8M0 scale: a bare power of two,
  stored as its biased exponent (one byte, 127 = 2^0; 255 would be NaN and is never produced);
* the exponent is rounded *up* -- scale = 2^ceil(log2(amax / 448)) -- so no element saturates (the OCP
  spec's floor(log2(amax)) - 8 can put a block's maximum above 448; Transformer Engine rounds up too);
* elements: e4m3(x / scale), round to nearest even, clamped to +-448 (the kernel converts with
  satfinite: both agree when rounding lands on the fp32-rounded amax / 448's edge);
* Hopper has no MXFP8 MMA: there the ``fp8`` recipe (``megatron_mok.fp8``: fp32 scales per 1 x 128 /
  128 x 128 block) runs instead.

``sm100_sf_offset`` is the byte offset of a block scale in the layout the sm_100 block-scaled MMA reads
(CUTLASS ``Sm1xxBlockScaledConfig``: 128-row x 4-scale atoms of 512 bytes, K atoms innermost), which the
quantiser can write directly so the GEMM needs no re-layout pass.
"""

from __future__ import annotations

import torch

MX_BLOCK = 32
E4M3_MAX = 448.0
_INV_MAX = 1.0 / E4M3_MAX  # amax * fp32(1/448): the same product the kernel forms (see megatron_mok.fp8)
SF_ATOM_ROWS = 128  # rows of one scale-factor atom
SF_ATOM_COLS = 4  # block scales (4 x 32 = 128 K elements) of one atom row
SF_ATOM_BYTES = SF_ATOM_ROWS * SF_ATOM_COLS


def e8m0_exponent(amax: torch.Tensor) -> torch.Tensor:
    """Biased UE8M0 exponent b (uint8) of the smallest power of two 2^(b - 127) >= amax / 448, from the
    fp32 bits of v = amax * fp32(1/448): b = exponent field + (mantissa != 0) for a normal v, clamped to
    [0, 254]; a subnormal v gets 0 (scale 2^-127) when v <= 2^-127, else 1."""
    v = (amax.float() * _INV_MAX).contiguous()
    bits = v.view(torch.int32)
    expo = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    normal = expo + (mant != 0).to(torch.int32)
    sub = (mant > 0x400000).to(torch.int32)  # 2^-127 is the subnormal with mantissa 2^22
    b = torch.where(expo == 0, sub, normal).clamp(0, 254)
    return b.to(torch.uint8)


def e8m0_to_float(b: torch.Tensor) -> torch.Tensor:
    """2^(b - 127) in fp32 (b = 0 gives the subnormal 2^-127)."""
    return torch.ldexp(torch.ones_like(b, dtype=torch.float32), b.to(torch.int32) - 127)


def quantize_mx_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 32) -> (e4m3 [M, K], UE8M0 exponents uint8 [M, K / 32], row-major)
    with x ~= q * 2^(b - 127) per 1 x 32 block."""
    if x.dim() != 2:
        raise ValueError(f"mxfp8 rows must be 2-D [rows, K], got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"mxfp8 rows must be a floating tensor, got {x.dtype}")
    M, K = x.shape
    if K % MX_BLOCK:
        raise ValueError(f"mxfp8: K={K} (shape {tuple(x.shape)}) must be a multiple of {MX_BLOCK}")
    blocks = x.float().view(M, K // MX_BLOCK, MX_BLOCK)
    b = e8m0_exponent(blocks.abs().amax(dim=2))
    # 1 / scale = 2^(127 - b): exact in fp32 for every b in [0, 254], so x * inv is exact (no rounding)
    inv = torch.ldexp(torch.ones_like(b, dtype=torch.float32), 127 - b.to(torch.int32))
    q = (blocks * inv.unsqueeze(2)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(M, K)
    return q, b


def dequantize_mx_rows(q: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    M, K = q.shape
    return (q.float().view(M, K // MX_BLOCK, MX_BLOCK) * e8m0_to_float(b).unsqueeze(2)).view(M, K)


def mxfp8_linear(xq: torch.Tensor, xb: torch.Tensor, wq: torch.Tensor, wb: torch.Tensor) -> torch.Tensor:
    """y = x @ w.T from MX-quantised x [M, K] and w [N, K] (both scaled along K), fp32 result: what the
    sm_100 block-scaled MMA computes (products of dequantised values, fp32 accumulation)."""
    return dequantize_mx_rows(xq, xb) @ dequantize_mx_rows(wq, wb).t()


def sm100_sf_offset(row: torch.Tensor, kblock: torch.Tensor, num_kblocks: int) -> torch.Tensor:
    """Byte offset of the scale of (row, 32-element K block) in the sm_100 scale-factor layout of a
    K-major operand with ``num_kblocks`` scales per row: atoms of 128 rows x 4 scales (512 B), ordered
    K atom fastest; inside an atom row r sits at (r % 32) * 16 + (r // 32) * 4, scale column c at + c."""
    k_atoms = -(-num_kblocks // SF_ATOM_COLS)
    atom = (row // SF_ATOM_ROWS) * k_atoms + kblock // SF_ATOM_COLS
    r = row % SF_ATOM_ROWS
    return atom * SF_ATOM_BYTES + (r % 32) * 16 + (r // 32) * 4 + kblock % SF_ATOM_COLS


def sm100_sf_bytes(rows: int, num_kblocks: int) -> int:
    """Bytes of the sm_100 scale-factor layout (rows padded to 128, scales per row to 4)."""
    return -(-rows // SF_ATOM_ROWS) * -(-num_kblocks // SF_ATOM_COLS) * SF_ATOM_BYTES


def to_sm100_sf_layout(b: torch.Tensor) -> torch.Tensor:
    """Row-major exponents [M, K / 32] -> the sm_100 layout (uint8, padding bytes 0 = the 2^-127 scale)."""
    M, nk = b.shape
    out = torch.zeros(sm100_sf_bytes(M, nk), dtype=torch.uint8, device=b.device)
    r = torch.arange(M, device=b.device).unsqueeze(1).expand(M, nk)
    k = torch.arange(nk, device=b.device).unsqueeze(0).expand(M, nk)
    out[sm100_sf_offset(r, k, nk).reshape(-1)] = b.reshape(-1)
    return out
