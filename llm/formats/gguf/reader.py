"""Load Llama-architecture GGUF files (llama.cpp's format) into MosaicGPT (their tokenizers:
:mod:`llm.data.gguf_tokenizer`; their metadata: :mod:`llm.utils.gguf`).

GGUF stores each tensor's dimensions innermost first; the ``gguf`` package's reader already gives
them outermost first (``(out_features, in_features)`` for a linear weight), which is torch's order.
Quantized tensors (Q4_0, Q4_1, Q8_0, K-quants, ...) are dequantized to float32 with
``gguf.quants.dequantize``.

llama.cpp's ``convert_hf_to_gguf.py`` permutes the rows of every query and key projection so that
the two halves of each rotary pair sit next to each other (GPT-J "interleaved" layout, which its
rope kernel expects). MosaicGPT, like transformers' Llama, rotates the two HALVES of each head
(``rotate_half``), so the permutation is undone here, as transformers does in
``LlamaTensorProcessor._reverse_permute_weights``.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import warnings
from typing import Any

import numpy as np
import torch

from llm.config import MosaicGPTConfig
from llm.generation.config import GenerationConfig
from llm.model import MosaicGPT
from llm.quant import Int4Linear, Int8Linear, quantize
from llm.quant.modules import QuantizationReport, int8_rows
from llm.kernels import cpu_quant
from llm.quant.quantize import (EMBEDDING, HEAD, check_backend, default_activation_dtype, head_packs, projections,
                                quantize_head)
from llm.utils.gguf import _MISSING, read_gguf
from llm.utils.memory import collector_paused, release_freed_memory
from llm.utils.gguf import field as _field

SUPPORTED_ARCHITECTURES = ("llama",)


def _architecture(reader) -> str:
    arch = _field(reader, "general.architecture", None)
    if arch is None:
        raise ValueError(f"GGUF file {reader.path} has no general.architecture: not a model file")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF file {reader.path} holds a {arch!r} model; supported architectures: {list(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def _per_model_int(reader, key: str, default: Any = _MISSING) -> int:
    """An integer hyper-parameter; llama.cpp allows a per-layer array, which must be uniform here."""
    value = _field(reader, key, default)
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ValueError(f"GGUF file {reader.path}: {key} varies per layer ({value}); not supported")
        value = value[0]
    return int(value)


def gguf_config(source, attn_impl: str = "sdpa") -> MosaicGPTConfig:
    """The MosaicGPTConfig of a Llama GGUF file (a path, or a reader from :func:`read_gguf`).

    Raises:
        ValueError: for another architecture, or Llama options MosaicGPT does not implement
            (rope scaling, partial rotary, a head size other than d_model / n_heads, experts).
    """
    reader = source if hasattr(source, "fields") else read_gguf(source)
    arch = _architecture(reader)
    a = f"{arch}."
    d_model = _per_model_int(reader, a + "embedding_length")
    n_heads = _per_model_int(reader, a + "attention.head_count")
    kv_n_heads = _per_model_int(reader, a + "attention.head_count_kv", n_heads)
    head_dim = d_model // n_heads
    problems = []
    if d_model % n_heads:
        problems.append(f"embedding_length {d_model} is not a multiple of head_count {n_heads}")
    for key in ("rope.dimension_count", "attention.key_length", "attention.value_length"):
        value = _field(reader, a + key, None)
        if value is not None and int(value) != head_dim:
            problems.append(f"{key}={value} differs from d_model/n_heads={head_dim}")
    scaling = _field(reader, a + "rope.scaling.type", "none")
    factor = float(_field(reader, a + "rope.scaling.factor", 1.0))
    if scaling not in ("none", "") and factor != 1.0:
        problems.append(f"rope scaling {scaling!r} (factor {factor})")
    if int(_field(reader, a + "expert_count", 0) or 0) > 0:
        problems.append("mixture of experts")
    if problems:
        raise ValueError(f"GGUF file {reader.path}: unsupported Llama options: " + "; ".join(problems))

    names = {t.name for t in reader.tensors}
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        vocab_size = len(tokens.data)
    elif a + "vocab_size" in reader.fields:
        vocab_size = int(_field(reader, a + "vocab_size"))
    elif embd is not None:
        vocab_size = int(embd.shape[-1])
    else:
        raise ValueError(f"GGUF file {reader.path} has neither a token list nor token_embd.weight")
    return MosaicGPTConfig(
        vocab_size=vocab_size,
        max_seq_len=int(_field(reader, a + "context_length")),
        d_model=d_model,
        n_heads=n_heads,
        n_layers=int(_field(reader, a + "block_count")),
        kv_n_heads=kv_n_heads,
        ffn_hidden_size=_per_model_int(reader, a + "feed_forward_length"),
        rope_theta=float(_field(reader, a + "rope.freq_base", 10000.0)),
        layer_norm_epsilon=float(_field(reader, a + "attention.layer_norm_rms_epsilon", 1e-5)),
        learned_pos_emb=False, rope=True, alibi=False, ffn_type="glu", ffn_act="silu", norm_type="rmsnorm",
        no_bias=True, tie_word_embeddings="output.weight" not in names, attn_impl=attn_impl,
    )


def _dequantizable(qtype) -> bool:
    from gguf import GGMLQuantizationType
    from gguf import quants

    traits = getattr(quants, "_type_traits", None)
    if traits is None:  # a gguf version without the private table: find out when dequantizing
        return True
    return qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) or qtype in traits


_DEQUANTIZE_ROWS = 4096
# Rows of a vocabulary-sized table dequantized at a time on the way to int8: the float block and
# its temporaries (gguf's dequantization, then int8_rows') are the load's peak beyond the model.
_HEAD_ROWS = 512


def _dequantize(tensor, path, rows: slice | None = None) -> torch.Tensor:
    """A GGUF tensor dequantized to float32 (only ``rows`` of a matrix, if given)."""
    from gguf.quants import dequantize

    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # GGUF lists dims innermost first
    data = tensor.data
    if rows is not None:
        data = data[rows]
        shape = (len(data), *shape[1:])
    try:
        if data.ndim == 2 and len(shape) == 2 and data.shape[0] == shape[0]:
            # row blocks: gguf's numpy dequantization makes float temporaries a few times the
            # size of its input, which for a vocabulary-sized table is most of a load's peak RSS
            array = np.empty(shape, dtype=np.float32)
            for start in range(0, shape[0], _DEQUANTIZE_ROWS):
                rows = data[start:start + _DEQUANTIZE_ROWS]
                array[start:start + len(rows)] = np.asarray(dequantize(rows, tensor.tensor_type)).reshape(len(rows), -1)
        else:
            array = np.asarray(dequantize(data, tensor.tensor_type), dtype=np.float32).reshape(shape)
    except NotImplementedError as err:
        raise ValueError(
            f"GGUF file {path}: tensor {tensor.name!r} has type {tensor.tensor_type.name}, "
            f"which gguf cannot dequantize"
        ) from err
    if not array.flags.writeable or not array.flags.c_contiguous:
        # F32 tensors are read-only views of the file mapping: copy so torch owns writable memory.
        array = np.array(array, dtype=np.float32, order="C", copy=True)
    return torch.from_numpy(array)


def _unpermute(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's rotary permutation of a query/key projection's rows.

    llama.cpp's converter does ``w.reshape(n_heads, 2, head_dim // 2, in).swapaxes(1, 2)`` (each
    head's two halves interleaved); this is the inverse.
    """
    rows = weight.shape[0]
    return weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _sources(reader, config: MosaicGPTConfig, model: MosaicGPT | None = None) -> dict[str, list[tuple[Any, int | None]]]:
    """Where each of MosaicGPT's tensors comes from: a list of (GGUF tensor, heads to unpermute
    or None) whose rows are concatenated (the fused Wqkv takes three). Checked before anything
    is read: every tensor present, none unexpected, every shape as the config needs (``model``:
    an empty one of ``config``, made here if not given).

    Raises:
        ValueError: for a tensor of a type gguf cannot dequantize (naming tensor and type), an
            unexpected or missing tensor, or a tensor of the wrong shape.
    """
    path = reader.path
    for t in reader.tensors:
        if not _dequantizable(t.tensor_type):
            raise ValueError(
                f"GGUF file {path}: tensor {t.name!r} has quantization type {t.tensor_type.name}, "
                f"which gguf cannot dequantize"
            )
    head_dim, h, kv = config.head_dim, config.n_heads, config.kv_n_heads
    own = {"token_embd.weight": "wte.weight", "output_norm.weight": "norm_f.weight"}
    if not config.tie_word_embeddings:
        own["output.weight"] = "lm_head.weight"
    for i in range(config.n_layers):
        own.update({
            f"blk.{i}.attn_norm.weight": f"blocks.{i}.norm_1.weight",
            f"blk.{i}.attn_output.weight": f"blocks.{i}.attn.out_proj.weight",
            f"blk.{i}.ffn_norm.weight": f"blocks.{i}.norm_2.weight",
            f"blk.{i}.ffn_gate.weight": f"blocks.{i}.ffn.gate_proj.weight",
            f"blk.{i}.ffn_up.weight": f"blocks.{i}.ffn.up_proj.weight",
            f"blk.{i}.ffn_down.weight": f"blocks.{i}.ffn.down_proj.weight",
        })
        for part in "qkv":
            own[f"blk.{i}.attn_{part}.weight"] = None  # fused below
    tensors = {t.name: t for t in reader.tensors}
    unexpected = sorted(set(tensors) - set(own))
    missing = sorted(set(own) - set(tensors))
    if unexpected or missing:
        raise ValueError(
            f"GGUF file {path} does not hold a Llama model MosaicGPT can load: "
            + "; ".join([f"unexpected tensor(s) {unexpected[:8]}"] * bool(unexpected)
                        + [f"missing tensor(s) {missing[:8]}"] * bool(missing))
        )

    def shape(t) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists dims innermost first

    sources = {ours: [(tensors[name], None)] for name, ours in own.items() if ours is not None}
    for i in range(config.n_layers):
        parts = [(tensors[f"blk.{i}.attn_{p}.weight"], heads) for p, heads in (("q", h), ("k", kv), ("v", None))]
        for (t, _), name, want in zip(parts, ("attn_q", "attn_k", "attn_v"),
                                      ((h * head_dim, config.d_model), (kv * head_dim, config.d_model),
                                       (kv * head_dim, config.d_model))):
            if shape(t) != want:
                raise ValueError(f"GGUF file {path}: blk.{i}.{name}.weight has shape {shape(t)}, expected {want}")
        sources[f"blocks.{i}.attn.Wqkv.weight"] = parts
    expected = (model if model is not None else MosaicGPT.empty(config)).state_dict()
    wrong = [f"{k}: file has {shape(parts[0][0])}, config needs {tuple(expected[k].shape)}"
             for k, parts in sources.items() if len(parts) == 1 and shape(parts[0][0]) != tuple(expected[k].shape)]
    if wrong:
        raise ValueError(f"GGUF file {path}: tensors do not fit its metadata: " + "; ".join(wrong[:8]))
    return sources


def _float(parts, path) -> torch.Tensor:
    """A tensor from its sources (see :func:`_sources`), dequantized to float32."""
    pieces = [_dequantize(t, path) for t, _ in parts]
    pieces = [_unpermute(w, heads) if heads else w for w, (_, heads) in zip(pieces, parts)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _int8_rows(parts, reader, pack: bool = False, pages=None) -> tuple[torch.Tensor, torch.Tensor]:
    """An output layer or embedding as int8 codes and scales from its GGUF tensor: a Q8_0 tensor's
    own codes and scales per 32 (:func:`q8_0_blocks`, scales (rows, cols // 32)), any other type
    quantized per row (:func:`llm.quant.modules.int8_rows`, scales (rows,)). A block of rows at a
    time, each block's file pages given back once read: a float32 copy of a whole vocabulary-sized
    table, or the table's file pages beside its codes, would be most of a 4-bit model's peak
    memory. With ``pack`` the codes come in our int8 kernel's layout
    (:func:`llm.kernels.cpu_quant.pack_int8`), packed block by block rather than as a second copy
    of the table (a Q8_0 table's blocks straight from the file, :func:`llm.kernels.cpu_quant.gguf_q8_pack`);
    with ``pages`` (:class:`llm.kernels.cpu_quant.HugePages`) too, into huge pages where they fit."""
    (tensor, _), = parts  # one source, never permuted (only query and key rows are)
    rows, cols = int(tensor.shape[-1]), int(tensor.shape[0])
    row_bytes = int(tensor.n_bytes) // rows
    native = tensor.tensor_type.name == "Q8_0"  # kept as the file's groups of 32
    shape = (-(-rows // cpu_quant.LANES), cols // 4, cpu_quant.LANES, 4) if pack else (rows, cols)
    codes = pages.empty(shape, torch.int8) if pack and pages is not None else None
    codes = torch.empty(shape, dtype=torch.int8) if codes is None else codes
    scales = torch.empty((rows, cols // 32) if native else rows, dtype=torch.float32)
    file_rows = _file_rows(tensor) if native and pack else None
    for start in range(0, rows, _HEAD_ROWS):
        block = slice(start, min(rows, start + _HEAD_ROWS))
        if file_rows is not None:  # the file's blocks straight into the codes' place
            lanes = slice(start // cpu_quant.LANES, -(-block.stop // cpu_quant.LANES))
            scales[block] = cpu_quant.gguf_q8_pack(file_rows[block], cols, codes=codes[lanes])[1]
            _release_bytes(reader, int(tensor.data_offset), int(tensor.data_offset) + block.stop * row_bytes)
            continue
        if native:
            block_codes, scales[block] = q8_0_blocks(tensor, block)
        else:
            block_codes, scales[block] = int8_rows(_dequantize(tensor, reader.path, block))
        if pack:  # _HEAD_ROWS is a multiple of the kernel's 16 rows: each block fills whole lanes
            packed = cpu_quant.pack_int8(block_codes)
            codes[start // cpu_quant.LANES:start // cpu_quant.LANES + len(packed)] = packed
        else:
            codes[block] = block_codes
        _release_bytes(reader, int(tensor.data_offset), int(tensor.data_offset) + (start + len(block_codes)) * row_bytes)
    return codes, scales


def gguf_state_dict(reader, config: MosaicGPTConfig) -> dict[str, torch.Tensor]:
    """MosaicGPT's float32 state dict from an open Llama GGUF file, with ``config`` from :func:`gguf_config`.

    Raises:
        ValueError: as :func:`_sources`.
    """
    return {name: _float(parts, reader.path) for name, parts in _sources(reader, config).items()}


#: Bits per weight of GGUF types (rounded down): 6 or more are kept as int8, fewer as int4.
_BITS = {"F32": 32, "F16": 16, "BF16": 16, "Q8_0": 8, "Q8_1": 8, "Q8_K": 8, "Q6_K": 6, "Q5_0": 5, "Q5_1": 5,
         "Q5_K": 5, "Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q3_K": 3, "Q2_K": 2}

#: Bytes per block of 32 weights of the 4-bit types kept as int4 groups: (fp16 d[, fp16 m], 16 bytes of nibbles).
_INT4_BLOCKS = {"Q4_0": 18, "Q4_1": 20}


def int4_blocks(tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_0 or Q4_1 tensor's own codes, as int4 groups of 32 in the int4 kernel's convention.

    A block of 32 weights holds an fp16 scale ``d`` (Q4_1: and an fp16 minimum ``m``) and 32
    4-bit codes ``q`` (the low nibbles of its 16 bytes are weights 0-15, the high nibbles 16-31;
    ggml-quants.c ``dequantize_row_q4_0/1``). Q4_0 means ``w = (q - 8) d`` and Q4_1
    ``w = q d + m``; the kernel computes ``(q - 8) scale + zero``, so scale = d and zero = 0
    (Q4_0) or ``m + 8 d`` (Q4_1). The codes are the file's own; nothing is requantized.

    Returns:
        (codes uint8 (rows, cols) in [0, 15], scales float32 (rows, cols // 32), zeros float32
        (rows, cols // 32)).
    """
    name = tensor.tensor_type.name
    rows = int(tensor.shape[1:].prod()) if len(tensor.shape) > 1 else 1
    blocks = torch.from_numpy(np.array(tensor.data, dtype=np.uint8, copy=True).reshape(rows, -1, _INT4_BLOCKS[name]))
    d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0].float()
    nibbles = blocks[..., -16:]
    codes = torch.cat([nibbles & 0xF, nibbles >> 4], dim=-1).reshape(rows, -1)
    if name == "Q4_1":
        zeros = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0].float() + 8 * d
    else:
        zeros = torch.zeros_like(d)
    return codes, d, zeros


#: Projections converted between two trims of the C heap while loading: each frees its unpacked
#: codes, which glibc would otherwise keep (the peak of loading SmolLM2 Q4_1: 130 MiB over the imports
#: with a trim every 10, 141 without).
_TRIM_EVERY = 10

#: Bytes per block of 32 Q8_0 weights: fp16 d, 32 int8 codes.
_Q8_0_BLOCK = 34


def q8_0_blocks(tensor, rows: slice | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 tensor's own codes (its ``rows``, default all), as int8 groups of 32.

    A block of 32 weights holds an fp16 scale ``d`` and 32 int8 codes ``q``, ``w = q d``
    (ggml-quants.c ``dequantize_row_q8_0``); :class:`~llm.quant.Int8Linear` in groups of 32 computes
    the same. The codes and scales are the file's own; nothing is requantized.

    Returns:
        (codes int8 (rows, cols), scales float32 (rows, cols // 32), each an fp16 value).
    """
    n = int(tensor.shape[1:].prod()) if len(tensor.shape) > 1 else 1
    data = np.asarray(tensor.data, dtype=np.uint8).reshape(n, -1)
    blocks = torch.from_numpy(np.array(data if rows is None else data[rows], copy=True))
    blocks = blocks.view(len(blocks), -1, _Q8_0_BLOCK)
    scales = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0].float()
    return blocks[..., 2:].contiguous().view(torch.int8).reshape(len(blocks), -1), scales


def _joined(parts, convert) -> tuple[torch.Tensor, ...]:
    """``convert(tensor)``'s tensors (row-major, a row per output) of every source of ``parts``,
    each source's rows unpermuted, concatenated row-wise (a fused Wqkv's q, k and v)."""
    pieces = [[_unpermute(b, heads) if heads else b for b in convert(t)] for t, heads in parts]
    return tuple(torch.cat(column) if len(column) > 1 else column[0] for column in zip(*pieces))


def _file_rows(tensor) -> torch.Tensor:
    """A quantized tensor's bytes, a row of blocks per output: a view of the file's read-only
    mapping, no copy (never written to: what is made from it is packed elsewhere)."""
    rows = np.asarray(tensor.data, dtype=np.uint8).reshape(int(tensor.shape[1:].prod()), -1)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(rows)


def _raw(parts) -> torch.Tensor:
    """The bytes of ``parts`` (see :func:`_sources`), a row of blocks per output, each source's rows
    unpermuted, the sources' rows concatenated: the file's mapping itself for one source taken as
    it is, else one copy."""
    views = [_file_rows(t) for t, _ in parts]
    if len(parts) == 1 and parts[0][1] is None:
        return views[0]
    out = torch.empty((sum(len(v) for v in views), views[0].shape[1]), dtype=torch.uint8)
    start = 0
    for view, (_, heads) in zip(views, parts):
        piece = out[start:start + len(view)]
        if heads:  # as _unpermute, written straight into its place
            half = len(view) // heads // 2
            piece.view(heads, 2, half, -1).copy_(view.view(heads, half, 2, -1).transpose(1, 2))
        else:
            piece.copy_(view)
        start += len(view)
    return out


def _native_layer(parts, bias, act, backend: str, device: torch.device, pages=None) -> torch.nn.Module | None:
    """The layer of a tensor whose sources are all Q4_0 / Q4_1, or all Q8_0, on ``device`` with the
    file's own codes, d and m (rows unpermuted); None for other types. Where our kernels run, the
    file's blocks go straight into their layout (:func:`llm.kernels.cpu_quant.gguf_q4_pack`,
    :func:`~llm.kernels.cpu_quant.gguf_q8_pack`), in ``pages``
    (:class:`llm.kernels.cpu_quant.HugePages`) where they fit; elsewhere through the unpacked codes
    (:func:`int4_blocks`, :func:`q8_0_blocks`)."""
    kinds = {t.tensor_type.name for t, _ in parts}
    ours = device.type == "cpu" and backend != "torch" and cpu_quant.available(device)
    in_features = int(parts[0][0].shape[0])
    if len(kinds) == 1 and kinds <= set(_INT4_BLOCKS) and ours:
        raw = _raw(parts)
        packed = cpu_quant.gguf_q4_pack(raw, in_features, pages)
        return Int4Linear.from_kernel_layout(*packed, len(raw), bias, 32, act, backend)
    if kinds <= set(_INT4_BLOCKS):
        return Int4Linear(*(b.to(device) for b in _joined(parts, int4_blocks)), bias, 32, act, backend)
    if kinds == {"Q8_0"} and ours:
        raw = _raw(parts)
        codes, scales = cpu_quant.gguf_q8_pack(raw, in_features, pages)
        return Int8Linear(codes, scales, bias, act, packed=True, in_features=in_features, backend=backend)
    if kinds == {"Q8_0"}:
        return Int8Linear(*(b.to(device) for b in _joined(parts, q8_0_blocks)), bias, act, backend=backend)
    return None


def _into(pages, module) -> None:
    """Move ``module``'s kernel tensors (codes, scales, mins: ``kernel_tensors()``) into ``pages``
    (:class:`llm.kernels.cpu_quant.HugePages`), as long as they fit; the copies are the same values."""
    if module.kernel_tensors() is None:
        return
    for key in ("weight", "kernel_scales", "kernel_mins"):
        tensor = module._buffers.get(key)
        copy = pages.copy(tensor) if tensor is not None and not pages.holds(tensor) else None
        if copy is not None:
            module._buffers[key] = copy


def _release(reader, parts) -> None:
    """Give back the memory-mapped file pages of ``parts``' tensors once converted: a read page of a
    mapping stays in the process's memory while the mapping lives, so a load would otherwise hold
    the whole file beside the model it made (read again from the page cache if touched)."""
    for tensor, _ in parts:
        _release_bytes(reader, int(tensor.data_offset), int(tensor.data_offset) + int(tensor.n_bytes))


def _release_file(reader) -> None:
    """Give back every page of ``reader``'s file mapping that a load left in the process's memory.
    The kernel maps a faulted page's neighbours with it (fault-around, large page-cache folios), so
    reading one tensor maps pages of tensors given back before it again: 16,682 of the 24,014
    pages of SmolLM2's file stayed after :func:`_release` of each tensor on a Zen 4 VM. A page read
    again later comes back from the page cache."""
    mapping = _mapping(reader)
    if mapping is not None:
        _release_bytes(reader, 0, len(mapping))


def _mapping(reader) -> mmap.mmap | None:
    """The ``mmap`` under ``reader``'s data, or None (a reader over other memory)."""
    mapping = reader.data
    while mapping is not None and not isinstance(mapping, mmap.mmap):
        mapping = getattr(mapping, "base", None)
    return mapping if hasattr(mapping, "madvise") else None


def _release_bytes(reader, start: int, end: int) -> None:
    """Give back the whole pages of bytes ``[start, end)`` of ``reader``'s file mapping (see :func:`_release`)."""
    mapping = _mapping(reader)
    if mapping is None:
        return
    start = start // mmap.PAGESIZE * mmap.PAGESIZE
    if end > start:
        try:
            mapping.madvise(mmap.MADV_DONTNEED, start, end - start)
        except (OSError, ValueError):  # not a mapping the OS lets go of: it stays until the reader goes
            pass


@collector_paused()
def load_gguf(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype | None = torch.float32,
    device: torch.device | str | None = None,
    attn_impl: str = "sdpa",
    quantization: str | None = None,
    group_size: int = 32,
    backend: str = "auto",
) -> MosaicGPT:
    """A MosaicGPT with the weights of a Llama-architecture GGUF file, in eval mode.

    Args:
        dtype: of the float weights, the activations and the cache (None: float32).
        quantization: None: ``"gguf"`` if the file's projections are quantized, else ``"none"``
            (as llama.cpp runs a file: on its own blocks); ``"none"``: every tensor dequantized to
            float32, then cast to ``dtype``;
            ``"int8"`` / ``"int4"``: each projection dequantized and quantized at once by
            :func:`llm.quant.quantize` (the float model is never whole in memory);
            ``"gguf"``: the file's own quantization where the kernels take it: Q4_0 / Q4_1
            projections become int4 groups of 32 with the file's codes (:func:`int4_blocks`),
            Q8_0 ones int8 groups of 32 with the file's codes and scales (:func:`q8_0_blocks`);
            projections of other types (K-quants, F16, ...) are dequantized and quantized:
            8-bit and wider to int8 per row, the rest to int4 groups of 32. The output layer
            (and a tied embedding) is the file's int8 groups where it is Q8_0, else int8 per row
            (in every mode: ``"int8"`` and ``"int4"`` too).
        group_size: int4 group size for ``quantization="int4"``.
        backend: whose kernels the quantized layers take (see :func:`llm.quant.quantize`).

    Raises:
        FileNotFoundError: if there is no such file.
        ValueError: for an unreadable (truncated, corrupt) file, another architecture than Llama
            (naming it and the supported ones), a tensor type gguf cannot dequantize (naming the
            tensor and type), Llama options MosaicGPT does not implement, an unknown quantization
            or backend.
    """
    if quantization not in (None, "none", "int8", "int4", "gguf"):
        raise ValueError(f"quantization must be None, 'none', 'int8', 'int4' or 'gguf', got {quantization!r}")
    check_backend(backend, device or "cpu")
    reader = read_gguf(path)
    try:
        return _load(reader, dtype=dtype, device=device, attn_impl=attn_impl, quantization=quantization,
                     group_size=group_size, backend=backend)
    finally:
        _release_file(reader)


def _load(reader, *, dtype: torch.dtype | None, device: torch.device | str | None, attn_impl: str,
          quantization: str | None, group_size: int, backend: str) -> MosaicGPT:
    """:func:`load_gguf`'s model from its open ``reader`` (arguments checked)."""
    config = gguf_config(reader, attn_impl=attn_impl)
    model = MosaicGPT.empty(config)
    sources = _sources(reader, config, model)
    if quantization is None:
        quantization = "gguf" if _quantized(reader) else "none"
    if quantization == "none":
        state = {name: _float(parts, reader.path) for name, parts in sources.items()}
        model.load_state_dict(state, strict=True, assign=True)
        return _with_generation_config(model.to(device=device, dtype=dtype or torch.float32).eval(), reader)
    owned = {f"{name}.weight" for name in projections(model)} | {"wte.weight" if model.lm_head is None else "lm_head.weight"}
    model.load_state_dict({name: _float(parts, reader.path).to(device=device, dtype=dtype or torch.float32)
                           for name, parts in sources.items() if name not in owned}, strict=False, assign=True)
    for name, parts in sources.items():
        if name not in owned:
            _release(reader, parts)
    head = HEAD if model.lm_head is not None else EMBEDDING
    if quantization in ("int8", "int4"):
        quantize(model, quantization, group_size, weights=lambda name: _float(sources[name], reader.path),
                 head=_int8_rows(sources[head + ".weight"], reader, head_packs(model, backend)), backend=backend)
        return _with_generation_config(model.eval(), reader)

    act = default_activation_dtype(model.device)
    report = QuantizationReport("int4", 32, str(act).removeprefix("torch."), source="gguf", backend=backend)
    pages = None
    if _huge_pages_apply(model.device, backend):
        pages = cpu_quant.HugePages(*_region_bytes(reader))
    for i, name in enumerate(projections(model)):
        parts = sources[name + ".weight"]
        linear = model.get_submodule(name)
        module = _native_layer(parts, linear.bias, act, backend, model.device, pages)
        if module is None:
            types = sorted({t.tensor_type.name for t, _ in parts})
            weight = _float(parts, reader.path).to(model.device)
            if min(_BITS.get(t, 16) for t in types) >= 6:
                module = Int8Linear.from_float(weight, linear.bias, act, backend)
                report.kept[name] = f"{'/'.join(types)}: requantized to int8 per row"
            else:
                module = Int4Linear.from_float(weight, linear.bias, 32, act, backend)
                report.kept[name] = f"{'/'.join(types)}: requantized to int4 groups of 32"
        if pages is not None:
            _into(pages, module)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, module)
        report.quantized.append(name)
        _release(reader, parts)
        if i % _TRIM_EVERY == _TRIM_EVERY - 1:  # the unpacked codes freed, back to the OS (about 1 ms a trim)
            _release_file(reader)
            release_freed_memory()
    quantize_head(model, _int8_rows(sources[head + ".weight"], reader, head_packs(model, backend), pages), act, backend)
    report.quantized.append(head)
    model.quantization = report
    release_freed_memory()
    return _with_generation_config(model.eval(), reader)


def _huge_pages_apply(device: torch.device, backend: str) -> bool:
    """Whether a GGUF load onto ``device`` with ``backend`` puts its blocks in huge pages."""
    return device.type == "cpu" and backend != "torch" and cpu_quant.available(device)


def _region_bytes(reader) -> tuple[int, int]:
    """(room, placed): the bytes of huge pages a load of ``reader``'s file reserves for the blocks'
    kernel tensors and the output layer's codes (the file's bytes of those tensors, with room for
    each matrix's rows padded to 16: an unused rest of the region costs nothing, and a layer
    requantized to more bytes than the file's may not fit, and stays outside), and a lower bound
    of what it places there (Q4_0 / Q4_1 / Q8_0 blocks take at least their file bytes in the
    kernels' layout where a layer's tensors are all of one such type; a Q8_0 output layer its
    codes, 32 of each 34 bytes; other layers, requantized, none)."""
    tensors = {t.name: t for t in reader.tensors}
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    room = placed = 0
    layers: dict[str, list] = {}  # our layer -> its file tensors (the fused qkv takes three)
    for name, t in tensors.items():
        if name == head:
            room += int(t.n_bytes) * 17 // 16 + 4096
            placed += int(t.n_bytes) * 32 // 34 if t.tensor_type.name == "Q8_0" else 0
        elif name.startswith("blk.") and len(t.shape) == 2:
            room += int(t.n_bytes) * 17 // 16 + 4096
            layers.setdefault(re.sub(r"\.attn_[qkv]\.", ".attn_qkv.", name), []).append(t)
    for parts in layers.values():  # kept as they are (_native_layer) only where all are one such type
        kinds = {t.tensor_type.name for t in parts}
        if len(kinds) == 1 and kinds <= {*_INT4_BLOCKS, "Q8_0"}:
            placed += sum(int(t.n_bytes) for t in parts)
    return room, placed


@contextlib.contextmanager
def preloading(name_or_path: str | os.PathLike):
    """Within the block, a GGUF file (a ``.gguf`` path or a registered name) is opened once: its
    header is parsed here and kept for the block, so that :func:`~llm.data.tokenizer.load_tokenizer`
    and ``MosaicGPT.from_pretrained`` share it (:func:`~llm.utils.gguf.read_gguf`). The commands
    load ``with preloading(...)``.

    Faulting the blocks' huge pages in on a thread of their own meanwhile, while the block parsed
    the tokenizer, made SmolLM2's tokenizer and model load slower, not faster: 0.51 s against 0.33 s
    (medians of 10 alternating processes, 2-core Zen 4 guest); that thread took 0.25-0.33 s for
    90 MB (about 0.01 s alone), most likely contending with the tokenizer for the interpreter lock
    and the memory map's. The thread that places each tensor faults its pages in
    (:class:`llm.kernels.cpu_quant.HugePages`).

    Anything else (a bundle, an unreadable file) loads as without it: the loads in the block raise
    their own errors.
    """
    from llm.utils.pretrained import resolve

    reader = None
    try:
        kind, path = resolve(name_or_path)
        if kind == "gguf":
            reader = read_gguf(path)
    except (OSError, ValueError):  # the load in the block says what is wrong
        reader = None
    try:
        yield
    finally:
        del reader  # held until here: the block's reads of the file share it


def _quantized(reader) -> bool:
    """Whether a file's projections are quantized (what ``quantization=None`` loads as ``"gguf"``)."""
    return any(t.tensor_type.name not in ("F32", "F16", "BF16") for t in reader.tensors
               if t.name.startswith("blk.") and len(t.shape) == 2)


def _with_generation_config(model: MosaicGPT, reader) -> MosaicGPT:
    """``model`` with the file's end ids as its generation config: ``tokenizer.ggml.eos_token_id``
    and, where the file has one, its end-of-turn token (``eot_token_id``, llama.cpp's), so that
    ``generate`` stops where llama.cpp stops; ``padding_token_id`` as the pad id."""
    ends = [_field(reader, f"tokenizer.ggml.{key}", None) for key in ("eos_token_id", "eot_token_id")]
    ends = list(dict.fromkeys(int(e) for e in ends if e is not None))
    pad = _field(reader, "tokenizer.ggml.padding_token_id", None)
    model.generation_config = GenerationConfig(eos_token_id=(ends[0] if len(ends) == 1 else ends) or None,
                                               pad_token_id=None if pad is None else int(pad))
    return model
