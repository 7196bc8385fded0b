"""Weight-only quantized layers: drop-in replacements for ``nn.Linear`` and ``nn.Embedding``.

After gpt-fast's ``WeightOnlyInt8Linear`` and ``WeightOnlyInt4Linear`` (quantize.py): the weights
are stored quantized and the matrix product is torch's quantized kernel
(:mod:`llm.kernels.quant`); activations enter the kernel in ``activation_dtype`` and leave in the
input's dtype, so the residual stream keeps the model's dtype.

State dicts hold device-independent tensors: int8 codes and float scales; for int4, the codes
unpacked (uint8, one per weight) with ``scales_and_zeros``. Packing for the kernel happens on
load and when the module moves to another device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from llm.kernels.quant import aligned, int4_matmul, int4_pack, int4_unpack, int8_matmul


_ROW_BLOCK = 4096


@dataclass
class QuantizationReport:
    """What :func:`llm.quant.quantize` did: ``method``, ``group_size``, ``activation_dtype`` (a
    torch dtype name), ``quantized`` (module names) and ``kept`` (module name -> why it stayed
    in floating point). Saved as ``quantization.json`` next to a quantized bundle's weights."""

    method: str
    group_size: int
    activation_dtype: str
    quantized: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)
    source: str = "quantized"

    def to_dict(self) -> dict:
        return dict(method=self.method, group_size=self.group_size, activation_dtype=self.activation_dtype,
                    quantized=list(self.quantized), kept=dict(self.kept), source=self.source)


def int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row (round to nearest): (codes int8 (rows, cols), scales float32 (rows,)).

    ``scale = max |w| / 127`` per row (1 for an all-zero row), so ``codes * scale`` is within
    ``scale / 2`` of ``w``.
    """
    rows = weight.shape[0]
    codes = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scales = torch.empty(rows, dtype=torch.float32, device=weight.device)
    # in blocks of rows: the float temporaries of a whole vocabulary-sized table would be a few
    # times its fp32 size (the peak RSS of loading a 4-bit model)
    for start in range(0, rows, _ROW_BLOCK):
        w = weight[start:start + _ROW_BLOCK].detach().float()
        s = w.abs().amax(dim=1) / 127
        s = torch.where(s == 0, torch.ones_like(s), s)
        codes[start:start + _ROW_BLOCK] = torch.round(w / s[:, None]).clamp_(-127, 127).to(torch.int8)
        scales[start:start + _ROW_BLOCK] = s
    return codes, scales


def int4_groups(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 in groups of ``group_size`` inputs (round to nearest, min-max range, as
    gpt-fast's ``get_group_qparams``): (codes uint8 (out, in) in [0, 15], scales and zeros, each
    float32 (out, in // group_size)), with ``w ~ (codes - 8) * scale + zero``."""
    out_features, in_features = weight.shape
    w = weight.detach().float().reshape(out_features, in_features // group_size, group_size)
    low, high = w.amin(dim=-1), w.amax(dim=-1)
    scales = (high - low) / 15
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)
    codes = torch.round((w - low[..., None]) / scales[..., None]).clamp_(0, 15)
    zeros = low + 8 * scales
    return codes.to(torch.uint8).reshape(out_features, in_features), scales, zeros


def _moves_device(fn, tensor: torch.Tensor) -> torch.device | None:
    """The device ``fn`` (an ``nn.Module._apply`` function) would move ``tensor`` to, if another."""
    device = fn(torch.empty(0, dtype=tensor.dtype, device=tensor.device)).device
    return device if device != tensor.device else None


class Int8Linear(nn.Module):
    """``nn.Linear`` with an int8 weight, one float scale per output feature.

    Buffers: ``weight`` int8 (out_features, in_features), ``scales`` (out_features,) float,
    ``bias`` (out_features,) float or None. ``forward``: (..., in_features) -> (..., out_features)
    in x's dtype, the product computed by ``aten._weight_int8pack_mm`` on x cast to
    ``activation_dtype``.
    """

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 activation_dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.activation_dtype = activation_dtype
        self.register_buffer("weight", aligned(weight))
        self.register_buffer("scales", scales)
        self.register_buffer("bias", bias)
        self._refresh_kernel_scales()

    def _refresh_kernel_scales(self) -> None:
        # The scales as the kernel takes them, cast once rather than at every call: inside a
        # compiled graph the per-call cast is an unrealized pointwise node that inductor's
        # _weight_int8pack_mm lowering (torch 2.7) rejects with an AssertionError.
        self.register_buffer("kernel_scales", self.scales.to(self.activation_dtype), persistent=False)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self._refresh_kernel_scales()
        return self

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self._refresh_kernel_scales()

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None, activation_dtype: torch.dtype) -> "Int8Linear":
        """Quantize a float (out_features, in_features) weight per row; see :func:`int8_rows`."""
        codes, scales = int8_rows(weight)
        return cls(codes, scales, bias, activation_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(self.activation_dtype)
        out = int8_matmul(flat, self.weight, self.kernel_scales).to(x.dtype).view(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, activations={self.activation_dtype}"


class Int8Embedding(nn.Module):
    """``nn.Embedding`` with int8 rows and one float scale per row (the vocabulary entry).

    Shares ``weight`` and ``scales`` with the output layer of a model whose embeddings are tied
    (see :meth:`tied_head`). ``forward``: (...,) int64 ids -> (..., embedding_dim) in the scales' dtype.
    """

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor):
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.register_buffer("weight", aligned(weight))
        self.register_buffer("scales", scales)

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> "Int8Embedding":
        """Quantize a float (num_embeddings, embedding_dim) table per row; see :func:`int8_rows`."""
        return cls(*int8_rows(weight))

    def tied_head(self, activation_dtype: torch.dtype) -> Int8Linear:
        """The output layer ``x @ E.T`` over the same int8 storage (no copy)."""
        return Int8Linear(self.weight, self.scales, None, activation_dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.weight[input_ids].to(self.scales.dtype) * self.scales[input_ids].unsqueeze(-1)


class Int4Linear(nn.Module):
    """``nn.Linear`` with an int4 weight in groups of ``group_size`` inputs, asymmetric
    (a scale and a zero per group), computed by ``aten._weight_int4pack_mm_for_cpu`` (CUDA:
    ``_weight_int4pack_mm``).

    Buffers: ``weight`` the kernel's packed codes, ``scales_and_zeros``
    (in_features // group_size, out_features, 2) in the activation dtype (the kernel takes them in
    x's dtype: x is cast to their dtype and the output back to x's; casting the module leaves
    them so), ``bias`` or None. The state
    dict holds the codes unpacked, uint8 (out_features, in_features), so a saved model loads on
    any CPU or GPU. ``forward``: (..., in_features) -> (..., out_features) in x's dtype.
    """

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bias: torch.Tensor | None,
                 group_size: int, activation_dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.group_size = group_size
        self._activation_dtype = activation_dtype
        self.register_buffer("weight", int4_pack(codes))
        self.register_buffer("scales_and_zeros", torch.stack([scales.t(), zeros.t()], dim=-1).to(activation_dtype).contiguous())
        self.register_buffer("bias", bias)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None, group_size: int,
                   activation_dtype: torch.dtype) -> "Int4Linear":
        """Quantize a float (out_features, in_features) weight; see :func:`int4_groups`."""
        return cls(*int4_groups(weight, group_size), bias, group_size, activation_dtype)

    @property
    def activation_dtype(self) -> torch.dtype:
        return self._activation_dtype

    def codes(self) -> torch.Tensor:
        """The int4 codes, uint8 (out_features, in_features) in [0, 15] (read back through the kernel)."""
        return int4_unpack(self.weight, self.out_features, self.in_features, self.group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(self.scales_and_zeros.dtype)
        out = int4_matmul(flat, self.weight, self.scales_and_zeros, self.group_size)
        out = out.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = self.codes()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        codes = state_dict.get(prefix + "weight")
        if codes is not None:
            if codes.dtype != torch.uint8 or tuple(codes.shape) != (self.out_features, self.in_features):
                error_msgs.append(f"{prefix}weight: expected int4 codes uint8 {(self.out_features, self.in_features)}, "
                                  f"got {codes.dtype} {tuple(codes.shape)}")
                return
            state_dict = dict(state_dict)
            state_dict[prefix + "weight"] = int4_pack(codes, self.scales_and_zeros.device
                                                      if self.scales_and_zeros.device.type != "meta" else codes.device)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def _apply(self, fn, recurse=True):
        # the packed layout belongs to its device: unpack before a move, pack again after it
        target = _moves_device(fn, self.weight) if self.weight.device.type != "meta" else None
        codes = self.codes() if target is not None else None
        super()._apply(fn, recurse)
        if codes is not None:
            self.weight = int4_pack(codes, target)
        # a cast of the model (to float32, say) must not move the kernel off its activation dtype
        self.scales_and_zeros = self.scales_and_zeros.to(self._activation_dtype)
        return self

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
                f"activations={self.activation_dtype}")
