"""``quantize(model, "int8" | "int4")``: swap a model's projections for weight-only quantized ones.

A module swap, as gpt-fast's ``WeightOnlyInt8QuantHandler`` / ``WeightOnlyInt4QuantHandler``:
every ``nn.Linear`` of the transformer blocks becomes an :class:`~llm.quant.Int8Linear` or
:class:`~llm.quant.Int4Linear`; the output layer becomes an int8 :class:`~llm.quant.Int8Linear`
in both modes (as llama.cpp's 4-bit files keep it at 6 or 8 bits: the logits are the most
sensitive product), and when the embeddings are tied the token embedding becomes an
:class:`~llm.quant.Int8Embedding` sharing its storage. Layers a kernel cannot take stay in
floating point, and the report names them.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
from torch import nn

from llm.kernels.quant import INT4_GROUP_SIZES, int4_supported
from llm.kernels import cpu_quant
from llm.quant.modules import (BACKENDS, Int4Linear, Int8Embedding, Int8Linear, QuantizationReport, _our_kernel,
                               int8_rows)

METHODS = ("int8", "int4")
#: The file next to a quantized bundle's weights that says how they are quantized.
QUANTIZATION_FILE = "quantization.json"
HEAD = "lm_head"
EMBEDDING = "wte"

log = logging.getLogger(__name__)

TensorSource = Callable[[str], torch.Tensor]


def default_activation_dtype(device: torch.device | str = "cpu") -> torch.dtype:
    """bfloat16 where the kernels are fastest with it (CUDA, and CPUs with AVX512-BF16 or AMX,
    where torch's CPU capability is AVX512), else float32."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if torch.backends.cpu.get_cpu_capability() == "AVX512" else torch.float32


def projections(model: nn.Module) -> list[str]:
    """Names of the ``nn.Linear`` modules of the transformer blocks (attention and feed-forward)."""
    return [name for name, module in model.named_modules() if name.startswith("blocks.") and isinstance(module, nn.Linear)]


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)
    if hasattr(model, "forget_weight_tensors"):
        model.forget_weight_tensors()


def check_backend(backend: str, device: torch.device | str = "cpu") -> None:
    """Raise ValueError for a ``backend`` that is not one of :data:`~llm.quant.modules.BACKENDS`,
    or ``"llm"`` on a device where our kernels cannot run (saying why)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "llm":
        if torch.device(device).type != "cpu":
            raise ValueError(f'backend "llm" runs on the CPU, not on {torch.device(device)}: use "auto" or "torch"')
        why = cpu_quant.unavailable()
        if why is not None:
            raise ValueError(f'backend "llm" cannot run here: {why}; use "auto" or "torch"')


def layer_kernels(model: nn.Module) -> dict[str, str]:
    """Which kernel each quantized layer of ``model`` takes now, by module name: ``"llm"`` (ours)
    or ``"torch"`` (see ``backend`` in :mod:`llm.quant.modules`)."""
    kernels = {}
    for name, module in model.named_modules():
        if isinstance(module, (Int4Linear, Int8Linear)):
            kernels[name] = module.kernel
        elif isinstance(module, Int8Embedding):
            kernels[name] = "llm" if module.packed else "torch"
    return kernels


def _check(method: str, group_size: int) -> None:
    if method not in METHODS:
        raise ValueError(f"quantization method must be one of {METHODS}, got {method!r}")
    if method == "int4" and (isinstance(group_size, bool) or group_size not in INT4_GROUP_SIZES):
        raise ValueError(f"group_size must be one of {INT4_GROUP_SIZES} for int4, got {group_size!r}")


@torch.no_grad()
def quantize(model: nn.Module, method: str, group_size: int = 32, activation_dtype: torch.dtype | None = None,
             *, backend: str = "auto", weights: TensorSource | None = None,
             head: tuple[torch.Tensor, torch.Tensor] | None = None) -> nn.Module:
    """Quantize ``model``'s weights in place (a module swap); returns the model.

    Args:
        model: a :class:`~llm.model.MosaicGPT` (in eval mode for inference; quantized layers have
            no gradients).
        method: ``"int8"`` (symmetric, one scale per output feature) or ``"int4"`` (asymmetric,
            a scale and a zero per ``group_size`` inputs); the output layer is int8 in both.
        group_size: inputs per int4 group (32, 64, 128 or 256); int8 has one scale per row (the
            group size is then recorded but unused).
        activation_dtype: the dtype activations enter the kernels in; default
            :func:`default_activation_dtype` of the model's device (bfloat16 on fast CPUs); torch's
            kernels only (ours quantize activations to int8 per 32 inputs).
        backend: whose kernels the layers take: ``"auto"`` (ours where they run, on x86-64 CPUs
            with AVX2 or AVX512-VNNI, torch's elsewhere, per layer and per device), ``"llm"``
            (ours; an error where they cannot run) or ``"torch"``. :func:`layer_kernels` says what
            each layer took.
        weights: where to read float weights from, by state-dict name (e.g. a file being loaded,
            so that the float model is never held whole); default: the model's own.
        head: the output layer (the embedding, when tied) already quantized, as ``(codes,
            scales)`` of :func:`~llm.quant.modules.int8_rows` (a loader that quantizes it a block
            of rows at a time) or in groups (scales (rows, groups): a GGUF file's Q8_0 blocks);
            default: quantized here per row from its float weight.

    Returns:
        The model, with ``model.quantization`` a :class:`~llm.quant.QuantizationReport` (also
        logged when a layer had to stay in floating point).

    Raises:
        ValueError: for an unknown method, a bad group size or backend (see :func:`check_backend`);
            if the model is already quantized.
    """
    _check(method, group_size)
    check_backend(backend, model.norm_f.weight.device)
    if getattr(model, "quantization", None) is not None:
        raise ValueError(f"the model is already quantized ({model.quantization.method}); load it again to requantize")
    device = model.norm_f.weight.device
    act = activation_dtype or default_activation_dtype(device)
    report = QuantizationReport(method, group_size, str(act).removeprefix("torch."), backend=backend)

    def weight(name: str) -> torch.Tensor:
        return weights(name + ".weight") if weights is not None else model.get_submodule(name).weight

    for name in projections(model):
        linear = model.get_submodule(name)
        if method == "int4":
            why = int4_supported(linear.out_features, linear.in_features, group_size, device)
            if why is not None:
                report.kept[name] = why
                if weights is not None:
                    linear.weight = nn.Parameter(weight(name).to(device), requires_grad=False)
                continue
            module = Int4Linear.from_float(weight(name).to(device), linear.bias, group_size, act, backend)
        else:
            module = Int8Linear.from_float(weight(name).to(device), linear.bias, act, backend)
        _set(model, name, module)
        report.quantized.append(name)
    if head is None:
        head = model.lm_head.weight if model.lm_head is not None else model.wte.weight
        if weights is not None:
            head = weights((HEAD if model.lm_head is not None else EMBEDDING) + ".weight")
    report.quantized.append(quantize_head(model, head, act, backend))
    if report.kept:
        log.warning("quantize(%s): %d layer(s) stay in floating point: %s", method, len(report.kept),
                    "; ".join(f"{k} ({v})" for k, v in report.kept.items()))
    model.quantization = report
    return model


def quantize_head(model: nn.Module, weight: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                  activation_dtype: torch.dtype, backend: str = "auto") -> str:
    """Make the output layer int8 per row from its float ``weight`` (vocab_size, d_model), or from
    its ``(codes, scales)`` already quantized by :func:`~llm.quant.modules.int8_rows` (or in groups,
    scales (vocab_size, d_model // group_size), as a GGUF file's Q8_0 blocks), the codes
    either (vocab_size, d_model) or, where :func:`head_packs`, already in our kernel's layout
    (4-D, :func:`llm.kernels.cpu_quant.pack_int8`); with tied embeddings the token embedding
    becomes an :class:`Int8Embedding` and the output layer shares its storage. Returns the name of
    the module quantized (``lm_head`` or ``wte``)."""
    codes, scales = weight if isinstance(weight, tuple) else int8_rows(weight.to(model.norm_f.weight.device))
    device = model.norm_f.weight.device
    codes, scales = codes.to(device), scales.to(device)
    packed = codes.dim() == 4
    if packed and not head_packs(model, backend):
        raise ValueError("packed output-layer codes given for a model whose output layer does not take our kernel")
    dim = model.norm_f.weight.shape[0]
    if model.lm_head is not None:
        _set(model, HEAD, Int8Linear(codes, scales, model.lm_head.bias, activation_dtype, packed=packed,
                                     in_features=dim, backend=backend))
        return HEAD
    embedding = Int8Embedding(codes, scales.to(model.norm_f.weight.dtype), backend, packed=packed, embedding_dim=dim)
    model.wte = embedding
    model.lm_head = embedding.tied_head(activation_dtype)
    return EMBEDDING


def head_packs(model: nn.Module, backend: str = "auto") -> bool:
    """Whether :func:`quantize_head` with ``backend`` gives ``model``'s output layer our int8 kernel
    (so its codes are kept packed in that kernel's layout)."""
    return _our_kernel(backend, model.norm_f.weight.device, model.config.vocab_size, model.config.d_model)


def quantize_like(model: nn.Module, spec: dict, tensors: TensorSource, backend: str = "auto") -> nn.Module:
    """Rebuild the quantized modules that ``spec`` (a saved :class:`QuantizationReport`, see
    :data:`QUANTIZATION_FILE`) lists, from their saved tensors (``tensors(state_dict_name)``).

    Every other tensor of the model is the caller's to load; ``backend`` as :func:`quantize`'s.
    Returns the model, with ``model.quantization`` set.

    Raises:
        ValueError: for a spec that is not a quantization report, or a tensor of the wrong dtype or
            shape; a bad backend.
    """
    check_backend(backend, model.norm_f.weight.device)
    try:
        report = QuantizationReport(**spec, backend=backend)
        _check(report.method, report.group_size)
        act = getattr(torch, report.activation_dtype)
    except (TypeError, AttributeError) as err:
        raise ValueError(f"not a quantization description: {spec!r} ({err})") from err
    device = model.norm_f.weight.device

    def tensor(name: str, dtype: torch.dtype | None, shape: tuple, t: torch.Tensor | None = None) -> torch.Tensor:
        t = tensors(name) if t is None else t
        if (dtype is not None and t.dtype != dtype) or tuple(t.shape) != shape:
            raise ValueError(f"{name}: expected {dtype or 'float'} {shape}, got {t.dtype} {tuple(t.shape)}")
        return t.to(device)

    def bias(name: str, linear: nn.Module) -> torch.Tensor | None:
        return None if getattr(linear, "bias", None) is None else tensor(name + ".bias", None, (linear.out_features,))

    def int8_scales(name: str, n: int, k: int) -> torch.Tensor:
        t = tensors(name)  # per row, or per group of a multiple of 32 inputs (a GGUF file's Q8_0 blocks)
        if tuple(t.shape) != (n,) and not (t.dim() == 2 and t.shape[0] == n and 0 < t.shape[1] <= k // 32
                                           and k % t.shape[1] == 0 and (k // t.shape[1]) % 32 == 0):
            raise ValueError(f"{name}: expected float ({n},) or ({n}, groups) with groups of a multiple of 32 of "
                             f"{k} inputs, got {t.dtype} {tuple(t.shape)}")
        return t.to(device)

    for name in report.quantized:
        if name == EMBEDDING:
            vocab, dim = model.wte.num_embeddings, model.wte.embedding_dim
            embedding = Int8Embedding(tensor("wte.weight", torch.int8, (vocab, dim)), int8_scales("wte.scales", vocab, dim),
                                      backend)
            model.wte = embedding
            model.lm_head = embedding.tied_head(act)
            continue
        linear = model.get_submodule(name)
        n, k = linear.out_features, linear.in_features
        codes = tensors(name + ".weight")
        # by the codes' dtype: a GGUF file's int4 model has int8 layers where its tensors are Q8_0
        if report.method == "int4" and name != HEAD and codes.dtype != torch.int8:
            sz = tensor(name + ".scales_and_zeros", None, (k // report.group_size, n, 2))
            module = Int4Linear(tensor(name + ".weight", torch.uint8, (n, k), codes), sz[..., 0].t(), sz[..., 1].t(),
                                bias(name, linear), report.group_size, act, backend)
        else:
            module = Int8Linear(tensor(name + ".weight", torch.int8, (n, k), codes),
                                int8_scales(name + ".scales", n, k), bias(name, linear), act, backend=backend)
        _set(model, name, module)
    model.quantization = report
    return model
