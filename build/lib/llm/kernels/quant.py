"""Weight-only quantized matrix products: int8 per output channel, int4 in groups along the input.

The kernels are torch's own (the ones gpt-fast and torchao call): on the CPU
``aten._weight_int8pack_mm`` and ``aten._weight_int4pack_mm_for_cpu`` (AVX-512 / AVX2 code, with
bf16 activations fastest where the CPU has AVX512-BF16 or AMX), on CUDA ``aten._weight_int8pack_mm``
and ``aten._weight_int4pack_mm`` (bf16 activations). Only the packed int4 layout differs between
devices (and between CPUs), so codes are packed when they reach their device and unpacked (by the
kernel itself, see :func:`int4_unpack`) when they are saved.

Conventions (those of the kernels):

- int8: ``w[n, k] = q[n, k] * scale[n]``, ``q`` int8 in [-127, 127].
- int4: ``w[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g]`` with ``g = k // group_size`` and
  ``q`` in [0, 15]; the kernel takes ``scale`` and ``zero`` interleaved as ``scales_and_zeros``
  of shape (in_features // group_size, out_features, 2), in the activations' dtype.
"""

from __future__ import annotations

import torch

INT4_GROUP_SIZES = (32, 64, 128, 256)
# The CUDA kernel's tiling of the packed layout (gpt-fast's inner_k_tiles).
_CUDA_INNER_K_TILES = 8


def aligned(tensor: torch.Tensor, alignment: int = 64) -> torch.Tensor:
    """``tensor``, copied to fresh (aligned) memory if its data does not start on an
    ``alignment``-byte boundary: the CPU int8 kernel with bf16 activations crashes on unaligned
    weights, which safetensors returns (tensors at arbitrary file offsets)."""
    return tensor.clone() if tensor.data_ptr() % alignment else tensor


def int4_supported(out_features: int, in_features: int, group_size: int, device: torch.device | str = "cpu") -> str | None:
    """Why an (out_features, in_features) weight cannot take the int4 kernel, or None if it can.

    The CPU kernel needs ``in_features`` to be a multiple of ``group_size`` (one of
    :data:`INT4_GROUP_SIZES`) and even; the CUDA kernel also needs ``out_features % 8 == 0`` and
    ``in_features % (16 * inner_k_tiles) == 0``.
    """
    if group_size not in INT4_GROUP_SIZES:
        return f"group_size {group_size} is not one of {INT4_GROUP_SIZES}"
    if in_features % group_size:
        return f"in_features {in_features} is not a multiple of group_size {group_size}"
    if torch.device(device).type == "cuda" and (out_features % 8 or in_features % (16 * _CUDA_INNER_K_TILES)):
        return f"the CUDA int4 kernel needs out_features % 8 == 0 and in_features % {16 * _CUDA_INNER_K_TILES} == 0"
    return None


def int4_pack(codes: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """Pack int4 codes for :func:`int4_matmul` on ``device`` (default: the codes' device).

    Args:
        codes: (out_features, in_features) integer tensor of values in [0, 15].

    Returns:
        The kernel's packed weight: uint8 (out_features, in_features // 2) on the CPU (a layout
        that depends on the CPU's instruction set), int32 tiles on CUDA.

    Raises:
        ValueError: for codes outside [0, 15] or a shape the kernel cannot take.
    """
    if codes.dim() != 2:
        raise ValueError(f"int4 codes must be 2-D (out_features, in_features), got shape {tuple(codes.shape)}")
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > 15):
        raise ValueError(f"int4 codes must lie in [0, 15], got [{int(codes.min())}, {int(codes.max())}]")
    device = torch.device(device) if device is not None else codes.device
    if device.type == "cuda":
        n, k = codes.shape
        pairs = codes.to(device=device, dtype=torch.uint8).view(n, k // 2, 2)
        return torch.ops.aten._convert_weight_to_int4pack((pairs[..., 0] << 4) | pairs[..., 1], _CUDA_INNER_K_TILES)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(device=device, dtype=torch.int32), 1)


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """``x @ w.T`` for an int4 weight (see the module docstring for ``w``).

    Args:
        x: (rows, in_features) in ``scales_and_zeros``' dtype (float32, bfloat16 or float16 on the
            CPU; bfloat16 on CUDA).
        packed: from :func:`int4_pack` on x's device.
        scales_and_zeros: (in_features // group_size, out_features, 2).
        group_size: input features per scale.

    Returns:
        (rows, out_features), x's dtype.
    """
    if x.is_cuda:
        return torch.ops.aten._weight_int4pack_mm(x, packed, group_size, scales_and_zeros)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)


def int4_unpack(packed: torch.Tensor, out_features: int, in_features: int, group_size: int) -> torch.Tensor:
    """The int4 codes (out_features, in_features) uint8 behind a packed weight, whatever its layout.

    The packed layout is the kernel's business (it differs between CPUs), so the codes are read
    back through the kernel: with every scale 1 and every zero 0 it multiplies by ``q - 8``,
    small integers that bfloat16 holds exactly, so the identity times the weight gives them.
    """
    ones = torch.ones(in_features // group_size, out_features, dtype=torch.bfloat16, device=packed.device)
    unit = torch.stack([ones, torch.zeros_like(ones)], dim=-1)
    eye = torch.eye(in_features, dtype=torch.bfloat16, device=packed.device)
    return (int4_matmul(eye, packed, unit, group_size).t() + 8).to(torch.uint8)


def int8_matmul(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x @ (weight * scales[:, None]).T``: (rows, in_features) x int8 (out, in) -> (rows, out), x's dtype.

    ``scales`` (out_features,) is cast to x's dtype, as the kernel needs.
    """
    return torch.ops.aten._weight_int8pack_mm(x, weight, scales.to(x.dtype))
