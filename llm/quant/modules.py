"""Weight-only quantized layers: drop-in replacements for ``nn.Linear`` and ``nn.Embedding``.

After gpt-fast's ``WeightOnlyInt8Linear`` and ``WeightOnlyInt4Linear`` (quantize.py): the weights
are stored quantized. Each layer's ``backend`` says whose kernel multiplies: ``"llm"``, our own
(:mod:`llm.kernels.cpu_quant`, llama.cpp's method: activations quantized to int8 per 32 inputs,
integer dot products; x86-64 CPUs with AVX2 or AVX512-VNNI), ``"torch"``, torch's quantized kernels
(:mod:`llm.kernels.quant`, activations entering them in ``activation_dtype``; any CPU or GPU), or
``"auto"``, ours where they run and torch's elsewhere, decided again whenever the layer moves to
another device; ``kernel`` says which one a layer took. Outputs leave in the input's dtype, so the
residual stream keeps the model's dtype.

State dicts hold device- and kernel-independent tensors: int8 codes and float scales; for int4,
the codes unpacked (uint8, one per weight) with ``scales_and_zeros``. Packing for the kernel
happens on load and when the module moves to another device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from llm.kernels import cpu_quant
from llm.kernels.quant import aligned, int4_matmul, int4_pack, int4_unpack, int8_matmul


_ROW_BLOCK = 4096
#: The values of a quantized layer's ``backend``.
BACKENDS = ("auto", "llm", "torch")


@dataclass
class QuantizationReport:
    """What :func:`llm.quant.quantize` did: ``method``, ``group_size``, ``activation_dtype`` (a
    torch dtype name), ``quantized`` (module names), ``kept`` (module name -> why it stayed
    in floating point) and the ``backend`` asked for. Saved as ``quantization.json`` next to a
    quantized bundle's weights, without the backend: that is the loader's choice."""

    method: str
    group_size: int
    activation_dtype: str
    quantized: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)
    source: str = "quantized"
    backend: str = "auto"

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


def int8_dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``codes * scales`` in ``dtype``: int8 codes (..., K) with scales per row (...) or per group of
    ``G`` inputs (..., K / G), each repeated over its group."""
    if scales.dim() == codes.dim():
        groups = scales.shape[-1]
        return (codes.to(dtype).unflatten(-1, (groups, -1)) * scales.to(dtype)[..., None]).flatten(-2)
    return codes.to(dtype) * scales.to(dtype)[..., None]


def _moves_device(fn, tensor: torch.Tensor) -> torch.device | None:
    """The device ``fn`` (an ``nn.Module._apply`` function) would move ``tensor`` to, if another."""
    device = fn(torch.empty(0, dtype=tensor.dtype, device=tensor.device)).device
    return device if device != tensor.device else None


def _our_kernel(backend: str, device: torch.device, out_features: int, in_features: int,
                group_size: int | None = None) -> bool:
    """Whether a layer of this shape on ``device`` with ``backend`` takes :mod:`llm.kernels.cpu_quant`'s
    kernels: ``"auto"`` and ``"llm"`` where they run and take the shape (a layer moved to a GPU or
    a shape they cannot take falls back to torch's), ``"torch"`` never."""
    return (backend != "torch" and device.type == "cpu"
            and cpu_quant.supports(out_features, in_features, group_size) is None and cpu_quant.available(device))


class _Int8Codes(nn.Module):
    """An int8 table ``weight`` of ``(rows, cols)`` codes, held packed for our CPU kernel when
    ``packed`` (see :func:`llm.kernels.cpu_quant.pack_int8`), else as they are; the state dict
    holds the codes (rows, cols) either way, and a move to another device packs them for it.

    Packed scales in groups (GGUF Q8_0's) are held once, as the kernel reads them: ``kernel_scales``,
    float16 lanes (:func:`llm.kernels.cpu_quant.lane_scales`), which hold a Q8_0 block's d exactly
    and are what the kernel multiplies by whatever the scales given. A float32 ``scales`` buffer
    beside them was 12% of a Q8_0 file's size in memory. The state dict still holds ``scales``
    (rows, groups) in the dtype they were given in (:meth:`group_scales`), and a move, a cast or a
    load sees them as a buffer. A cast or a load writes the lanes in place, so that a tied output
    layer goes on sharing them and the model's weights version (its caches' check) moves.
    """

    packed: bool
    backend: str

    def _shape(self) -> tuple[int, int]:
        raise NotImplementedError

    def _set_codes(self, codes: torch.Tensor) -> None:
        self.packed = _our_kernel(self.backend, codes.device, *self._shape())
        self.register_buffer("weight", cpu_quant.pack_int8(codes) if self.packed else aligned(codes))
        self._refresh()

    def _refresh(self) -> None:
        """Called after the codes or scales change (a load, a move, a cast)."""
        self._lane_group_scales()

    def _lane_group_scales(self) -> bool:
        """Packed scales in groups to the kernel's lanes, held there alone (into the lanes held
        before where they fit: :meth:`_scales_as_buffer`); whether it did."""
        scales = self._buffers.get("scales")
        held = self.__dict__.pop("_held_lanes", None)
        if not (self.packed and scales is not None and scales.dim() == 2):
            return False
        lanes = cpu_quant.lane_scales(scales)
        if held is not None and (held.shape, held.dtype, held.device) == (lanes.shape, lanes.dtype, lanes.device):
            lanes = held.copy_(lanes)
        self.register_buffer("kernel_scales", lanes, persistent=False)
        self._scales_dtype = scales.dtype  # what the state dict and a lookup give, as before
        del self._buffers["scales"]
        return True

    @property
    def scales_in_lanes(self) -> bool:
        """Whether the scales are held only in the kernel's lanes (packed, in groups)."""
        return "scales" not in self._buffers

    def group_scales(self) -> torch.Tensor:
        """The scales as the state dict holds them: (rows,), or (rows, groups) from the kernel's
        lanes where it holds them (:attr:`scales_in_lanes`), in the dtype they were given in."""
        if self.scales_in_lanes:
            return cpu_quant.unlane_scales(self.kernel_scales, self._shape()[0]).to(self._scales_dtype)
        return self.scales

    def _scales_as_buffer(self) -> bool:
        """Scales held in lanes as a ``scales`` buffer again, for a move, a cast or a load to see,
        the lanes kept aside to be written in place by :meth:`_lane_group_scales`; whether it did."""
        if not self.scales_in_lanes:
            return False
        self.register_buffer("scales", self.group_scales())
        self._held_lanes = self._buffers.pop("kernel_scales")
        return True

    def codes(self) -> torch.Tensor:
        """The int8 codes, (rows, cols)."""
        return cpu_quant.unpack_int8(self.weight, self._shape()[0]) if self.packed else self.weight

    def _apply(self, fn, recurse=True):
        self._scales_as_buffer()
        target = _moves_device(fn, self.weight) if self.weight.device.type != "meta" else None
        codes = self.codes() if target is not None else None
        super()._apply(fn, recurse)
        if codes is not None:
            self._set_codes(codes.to(target))
        self._refresh()
        return self

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = self.codes()
        if self.scales_in_lanes:
            destination[prefix + "scales"] = self.group_scales()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # loaded (its shape checked) into a buffer, laned again whatever happens to the load
        laned = prefix + "scales" in state_dict and self._scales_as_buffer()
        if self.scales_in_lanes:  # held in lanes, and the state dict has none
            missing_keys.append(prefix + "scales")
        try:
            self._load_codes_and_buffers(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                         error_msgs)
        finally:
            if laned:
                self._lane_group_scales()

    def _load_codes_and_buffers(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                error_msgs):
        codes = state_dict.get(prefix + "weight")
        if codes is not None and self.packed:
            if codes.dtype != torch.int8 or tuple(codes.shape) != self._shape():
                error_msgs.append(f"{prefix}weight: expected int8 codes {self._shape()}, "
                                  f"got {codes.dtype} {tuple(codes.shape)}")
                return
            state_dict = dict(state_dict)
            state_dict[prefix + "weight"] = cpu_quant.pack_int8(codes)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        self._refresh()


class Int8Linear(_Int8Codes):
    """``nn.Linear`` with an int8 weight, one float scale per output feature, or one per group of
    ``group_size`` inputs of each output feature (GGUF Q8_0's blocks: ``w = q * d`` per 32).

    With our kernels (``kernel`` ``"llm"``, see ``backend`` in the module docstring) the product is
    :func:`llm.kernels.cpu_quant.int8_linear` (activations quantized to int8 per 32 inputs, integer
    dot products; group scales taken as float16, which Q8_0's are), else torch's
    ``aten._weight_int8pack_mm`` on x cast to ``activation_dtype`` (``kernel`` ``"torch"``; torch
    has no kernel for group scales: the weight is then dequantized to ``activation_dtype`` at
    each call, a fallback for devices ours do not run on).

    Buffers: ``weight`` int8 codes ((out_features, in_features); in the ``"llm"`` kernel's blocked
    layout, see :meth:`codes`), ``scales`` (out_features,) or (out_features, in_features //
    group_size) float, ``bias`` (out_features,) float or None. The state dict holds the codes
    (out_features, in_features) whatever the kernel. ``forward``: (..., in_features) ->
    (..., out_features) in x's dtype.
    """

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 activation_dtype: torch.dtype, *, packed: bool = False, in_features: int | None = None,
                 backend: str = "auto"):
        super().__init__()
        self.backend = backend
        self.out_features = scales.shape[0]
        self.in_features = in_features if packed else weight.shape[1]
        self.group_size = self.in_features // scales.shape[1] if scales.dim() == 2 else None
        self.activation_dtype = activation_dtype
        self.register_buffer("scales", scales)
        self.register_buffer("bias", bias)
        if packed:
            self.packed = True
            self.register_buffer("weight", weight)
            self._refresh()
        else:
            self._set_codes(weight)

    def _shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    @property
    def kernel(self) -> str:
        """``"llm"`` (our CPU kernel) or ``"torch"``."""
        return "llm" if self.packed else "torch"

    def _refresh(self) -> None:
        # The scales as the kernel takes them, cast once rather than at every call: inside a
        # compiled graph the per-call cast is an unrealized pointwise node that inductor's
        # _weight_int8pack_mm lowering (torch 2.7) rejects with an AssertionError.
        self._lane_group_scales()
        if not self.scales_in_lanes:
            scales = cpu_quant.lane_scales(self.scales) if self.packed else self.scales.to(self._torch_dtype())
            self.register_buffer("kernel_scales", scales, persistent=False)
        cpu_quant.changed()

    def _torch_dtype(self) -> torch.dtype:
        # torch 2.7's CPU kernel with bfloat16 or float16 activations reads past the rows when
        # in_features % 16 != 0 (wrong results, or a segfault from 18 rows on): float32 there
        if self.weight.device.type == "cpu" and self.in_features % 16:
            return torch.float32
        return self.activation_dtype

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None, activation_dtype: torch.dtype,
                   backend: str = "auto") -> "Int8Linear":
        """Quantize a float (out_features, in_features) weight per row; see :func:`int8_rows`."""
        codes, scales = int8_rows(weight)
        return cls(codes, scales, bias, activation_dtype, backend=backend)

    def kernel_tensors(self) -> tuple[torch.Tensor, torch.Tensor, None] | None:
        """(codes, scales, None) in our CPU kernel's layouts for a fused kernel
        (:func:`llm.kernels.cpu_quant.decoder_blocks`), or None on torch's kernel or with a bias."""
        return (self.weight, self.kernel_scales, None) if self.packed and self.bias is None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.packed:
            out = cpu_quant.int8_linear(flat, self.weight, self.kernel_scales, self.out_features)
        elif self.group_size is not None:
            dtype = self.kernel_scales.dtype
            out = flat.to(dtype) @ int8_dequantize(self.weight, self.kernel_scales, dtype).t()
        else:
            out = int8_matmul(flat.to(self.kernel_scales.dtype), self.weight, self.kernel_scales)
        out = out.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        activations = "int8 per 32" if self.packed else self._torch_dtype()
        groups = "" if self.group_size is None else f", group_size={self.group_size}"
        return (f"in_features={self.in_features}, out_features={self.out_features}{groups}, kernel={self.kernel}, "
                f"activations={activations}")


class Int8Embedding(_Int8Codes):
    """``nn.Embedding`` with int8 rows and one float scale per row (the vocabulary entry), or one
    per group of inputs of each row (``scales`` (num_embeddings, groups): GGUF Q8_0's blocks).

    Shares ``weight`` and ``scales`` (packed in groups: ``kernel_scales``) with the output layer of
    a model whose embeddings are tied (see :meth:`tied_head`): the codes are kept in the layout of
    the output layer's kernel and looked up there; ``packed`` codes come in that layout already,
    with ``embedding_dim`` given.
    The state dict holds them (num_embeddings, embedding_dim).
    ``forward``: (...,) int64 ids -> (..., embedding_dim) in the scales' dtype.
    """

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, backend: str = "auto", *, packed: bool = False,
                 embedding_dim: int | None = None):
        super().__init__()
        self.backend = backend
        self.num_embeddings = scales.shape[0]
        self.embedding_dim = embedding_dim if packed else weight.shape[1]
        self.register_buffer("scales", scales)
        if packed:  # codes already in the kernel's layout (llm.kernels.cpu_quant.pack_int8)
            self.packed = True
            self.register_buffer("weight", weight)
            self._refresh()
        else:
            self._set_codes(weight)

    def _shape(self) -> tuple[int, int]:
        return self.num_embeddings, self.embedding_dim

    @classmethod
    def from_float(cls, weight: torch.Tensor, backend: str = "auto") -> "Int8Embedding":
        """Quantize a float (num_embeddings, embedding_dim) table per row; see :func:`int8_rows`."""
        return cls(*int8_rows(weight), backend=backend)

    def tied_head(self, activation_dtype: torch.dtype) -> Int8Linear:
        """The output layer ``x @ E.T`` over the same int8 storage (no copy)."""
        head = Int8Linear(self.weight, self.group_scales(), None, activation_dtype, packed=self.packed,
                          in_features=self.embedding_dim, backend=self.backend)
        if self.scales_in_lanes and head.scales_in_lanes:  # the same lanes, not a copy
            head.kernel_scales = self.kernel_scales
        return head

    def kernel_lookup(self) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """(codes, scales, rows) as ``llm::int8_embedding`` takes them where :meth:`forward` is that
        operator's float32 lookup (for :func:`llm.kernels.cpu_quant.decode_tokens`), else None."""
        if self.packed and self.scales_in_lanes and self._scales_dtype == torch.float32:
            return self.weight, self.kernel_scales, self.num_embeddings
        if self.packed and not self.scales_in_lanes and self.scales.dtype == torch.float32:
            return self.weight, self.scales, -1
        return None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.packed and self.scales_in_lanes:
            rows = cpu_quant.int8_embedding(self.weight, self.kernel_scales, input_ids.long(), self.num_embeddings)
            return rows.to(self._scales_dtype)
        if self.packed and self.scales.dtype == torch.float32:
            return cpu_quant.int8_embedding(self.weight, self.scales, input_ids.long())  # int32 ids too, as nn.Embedding
        rows = cpu_quant.gather_int8_rows(self.weight, input_ids) if self.packed else self.weight[input_ids]
        return int8_dequantize(rows, self.scales[input_ids], self.scales.dtype)


class Int4Linear(nn.Module):
    """``nn.Linear`` with an int4 weight in groups of ``group_size`` inputs, asymmetric (a scale and
    a zero per group): ``w = (q - 8) * scale + zero``, ``q`` in [0, 15].

    With our kernels (``kernel`` ``"llm"``, see ``backend`` in the module docstring) the product is
    :func:`llm.kernels.cpu_quant.int4_linear` (float16 scales and mins ``zero - 8 * scale``, which
    hold a GGUF Q4_1 or Q4_0 block's own d and m exactly; activations quantized to int8 per 32
    inputs; without mins where every zero is 0, as in a Q4_0 block). Elsewhere it is torch's
    ``aten._weight_int4pack_mm_for_cpu`` (CUDA: ``_weight_int4pack_mm``; ``kernel`` ``"torch"``)
    with ``scales_and_zeros`` (in_features // group_size, out_features, 2) in ``activation_dtype``,
    x cast to it and the output back.

    ``weight`` holds the kernel's packed codes. The state dict holds them unpacked, uint8
    (out_features, in_features), with ``scales_and_zeros`` as above (float32 from the ``"llm"``
    kernel), so a saved model loads on any CPU or GPU. ``forward``: (..., in_features) ->
    (..., out_features) in x's dtype.
    """

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bias: torch.Tensor | None,
                 group_size: int, activation_dtype: torch.dtype, backend: str = "auto"):
        super().__init__()
        self._setup(*codes.shape, bias, group_size, activation_dtype, backend)
        self._set_weights(codes, scales, zeros)

    def _setup(self, out_features: int, in_features: int, bias: torch.Tensor | None, group_size: int,
               activation_dtype: torch.dtype, backend: str) -> None:
        self.backend = backend
        self.out_features, self.in_features = out_features, in_features
        self.group_size = group_size
        self._activation_dtype = activation_dtype
        self.register_buffer("bias", bias)

    def _set_weights(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> None:
        """Pack codes (out, in) with scales and zeros (out, in // group_size) for the kernel of their device."""
        device = codes.device
        if _our_kernel(self.backend, device, self.out_features, self.in_features, self.group_size):
            scales, zeros = scales.float(), zeros.float()
            # zeros all 0 (GGUF Q4_0's symmetric blocks): no mins to store or read, min = -8 scale
            self._set_packed(*cpu_quant.pack_int4(codes, scales, None if not zeros.any() else zeros - 8 * scales))
            return
        for name in ("kernel_scales", "kernel_mins"):
            self._buffers.pop(name, None)
        self.kernel = "torch"
        self.register_buffer("weight", int4_pack(codes, device))
        self.register_buffer("scales_and_zeros", torch.stack([scales.t(), zeros.t()], dim=-1)
                             .to(device=device, dtype=self._activation_dtype).contiguous())
        cpu_quant.changed()

    def _set_packed(self, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None) -> None:
        """Take weights in our kernel's int4 layout (:func:`llm.kernels.cpu_quant.pack_int4`'s)."""
        self._buffers.pop("scales_and_zeros", None)
        self.kernel = "llm"
        self.register_buffer("weight", packed)
        self.register_buffer("kernel_scales", scales, persistent=False)
        self.register_buffer("kernel_mins", mins, persistent=False)
        cpu_quant.changed()

    @classmethod
    def from_kernel_layout(cls, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                           out_features: int, bias: torch.Tensor | None, group_size: int,
                           activation_dtype: torch.dtype, backend: str = "auto") -> "Int4Linear":
        """A layer from weights already in our kernel's int4 layout (``pack_int4``'s, or
        ``gguf_q4_pack``'s from a GGUF file's blocks), kept as they are where the layer takes our
        kernel and unpacked for torch's elsewhere."""
        in_features = packed.shape[1] * 8
        if not _our_kernel(backend, packed.device, out_features, in_features, group_size):
            codes, d, m = cpu_quant.unpack_int4(packed, scales, mins, out_features)
            return cls(codes, d.float(), m.float() + 8 * d.float(), bias, group_size, activation_dtype, backend)
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._setup(out_features, in_features, bias, group_size, activation_dtype, backend)
        layer._set_packed(packed, scales, mins)
        return layer

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None, group_size: int,
                   activation_dtype: torch.dtype, backend: str = "auto") -> "Int4Linear":
        """Quantize a float (out_features, in_features) weight; see :func:`int4_groups`."""
        return cls(*int4_groups(weight, group_size), bias, group_size, activation_dtype, backend)

    @property
    def activation_dtype(self) -> torch.dtype:
        return self._activation_dtype

    def codes(self) -> torch.Tensor:
        """The int4 codes, uint8 (out_features, in_features) in [0, 15]."""
        if self.kernel == "llm":
            return cpu_quant.unpack_int4(self.weight, self.kernel_scales, self.kernel_mins, self.out_features)[0]
        return int4_unpack(self.weight, self.out_features, self.in_features, self.group_size)

    def groups(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The scales and zeros, float32 (out_features, in_features // group_size) each, as the
        kernel holds them (``w = (q - 8) * scale + zero``)."""
        if self.kernel == "llm":
            _, scales, mins = cpu_quant.unpack_int4(self.weight, self.kernel_scales, self.kernel_mins, self.out_features)
            return scales.float(), mins.float() + 8 * scales.float()
        return self.scales_and_zeros[..., 0].t().float(), self.scales_and_zeros[..., 1].t().float()

    def kernel_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(codes, scales, mins) in our CPU kernel's layouts for a fused kernel
        (:func:`llm.kernels.cpu_quant.decoder_blocks`), or None on torch's kernel or with a bias."""
        return (self.weight, self.kernel_scales, self.kernel_mins) if self.kernel == "llm" and self.bias is None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.kernel == "llm":
            out = cpu_quant.int4_linear(flat, self.weight, self.kernel_scales, self.kernel_mins, self.group_size,
                                        self.out_features)
        else:
            out = int4_matmul(flat.to(self.scales_and_zeros.dtype), self.weight, self.scales_and_zeros, self.group_size)
        out = out.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = self.codes()
        if self.kernel == "llm":
            scales, zeros = self.groups()
            destination[prefix + "scales_and_zeros"] = torch.stack([scales.t(), zeros.t()], dim=-1).contiguous()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        codes, groups = state_dict.get(prefix + "weight"), state_dict.get(prefix + "scales_and_zeros")
        shape = (self.in_features // self.group_size, self.out_features, 2)
        if codes is not None and (codes.dtype != torch.uint8 or tuple(codes.shape) != (self.out_features, self.in_features)):
            error_msgs.append(f"{prefix}weight: expected int4 codes uint8 {(self.out_features, self.in_features)}, "
                              f"got {codes.dtype} {tuple(codes.shape)}")
            return
        if groups is not None and tuple(groups.shape) != shape:
            error_msgs.append(f"{prefix}scales_and_zeros: expected {shape}, got {tuple(groups.shape)}")
            return
        for key, value in ((prefix + "weight", codes), (prefix + "scales_and_zeros", groups)):
            if value is None:
                missing_keys.append(key)
        rest = {k: v for k, v in state_dict.items() if k not in (prefix + "weight", prefix + "scales_and_zeros")}
        if codes is not None and groups is not None:
            device = self.weight.device if self.weight.device.type != "meta" else codes.device
            self._set_weights(codes.to(device), groups[..., 0].t().to(device), groups[..., 1].t().to(device))
        missing = []
        super()._load_from_state_dict(rest, prefix, local_metadata, strict, missing, unexpected_keys, error_msgs)
        missing_keys.extend(k for k in missing if k not in (prefix + "weight", prefix + "scales_and_zeros"))

    def _apply(self, fn, recurse=True):
        # the packed layout belongs to its device and kernel: unpack before a move, pack again after it
        target = _moves_device(fn, self.weight) if self.weight.device.type != "meta" else None
        weights = (self.codes(), *self.groups()) if target is not None else None
        super()._apply(fn, recurse)
        if weights is not None:
            self._set_weights(*(t.to(target) for t in weights))
        # a cast of the model (to float32, say) must not move the kernel off its own dtypes
        if self.kernel == "llm":
            self.kernel_scales = self.kernel_scales.to(torch.float16)
            if self.kernel_mins is not None:
                self.kernel_mins = self.kernel_mins.to(torch.float16)
        else:
            self.scales_and_zeros = self.scales_and_zeros.to(self._activation_dtype)
        cpu_quant.changed()
        return self

    def extra_repr(self) -> str:
        activations = "int8 per 32" if self.kernel == "llm" else self.activation_dtype
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
                f"kernel={self.kernel}, activations={activations}")
