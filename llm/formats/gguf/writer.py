"""Export to GGUF for llama.cpp (and Ollama, LM Studio...): the inverse of :mod:`llm.formats.gguf.reader`.

Written with the ``gguf`` package's ``GGUFWriter`` as llama.cpp's ``convert_hf_to_gguf.py`` does:
the ``llama`` architecture's metadata, the tokenizer (``tokenizer.ggml.*``: a byte-level BPE
vocabulary, its merges, token types, pre-tokenizer name, special ids and chat template), and the
tensors under llama.cpp's names with Q and K rows permuted into its rotary order. Types:

- ``f32``: every tensor float32;
- ``f16``: matrices float16, norms float32;
- ``q8_0`` / ``q4_1``: matrices quantized by the ``gguf`` package's own quantizers (llama.cpp's
  reference rounding), norms float32; with ``q4_1`` the token embedding and output layer are
  ``q8_0``, as in llama.cpp's own Q4_1 files. A matrix whose rows are not a whole number of
  32-value blocks is written float16.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from llm.formats.files import check_replaceable, make_parent
from llm.io import fresh_sibling, remove_stale_siblings
from llm.formats.transformers import architecture

GGUF_TYPES = ("f32", "f16", "q8_0", "q4_0", "q4_1")

# llama.cpp's token types
_NORMAL, _CONTROL, _USER_DEFINED, _UNUSED = 1, 3, 4, 5
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def permute(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Q or K rows from transformers' rotary layout (halves) to llama.cpp's (interleaved pairs):
    ``convert_hf_to_gguf.py``'s ``LlamaModel.permute``."""
    rows = weight.shape[0]
    return weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _check(model) -> None:
    if getattr(model, "quantization", None) is not None:
        raise ValueError("a quantized model cannot be exported to GGUF: load it unquantized (a GGUF file with "
                         "quantization=\"none\"; a quantized bundle holds no float weights) and choose --gguf-type")
    c = model.config
    if architecture(c) != "llama":
        raise ValueError("GGUF export writes llama.cpp's llama architecture: rope, ffn_type glu, ffn_act silu, "
                         "norm_type rmsnorm (this model has learned_pos_emb={}, alibi={})".format(
                             c.learned_pos_emb, c.alibi))
    if not c.no_bias:
        raise ValueError("GGUF export of the llama architecture needs no_bias: true (this model has biases)")


def gguf_tensors(model, gguf_type: str = "f32") -> list[tuple[str, np.ndarray, object]]:
    """``(llama.cpp name, data, GGMLQuantizationType)`` per tensor: data float32/float16 in
    (rows, columns) order, or the quantized blocks as uint8 (rows, bytes).

    Raises:
        ValueError: for a gguf_type not in :data:`GGUF_TYPES`, or a model GGUF cannot hold
            (see :func:`save_gguf`).
    """
    from gguf import GGMLQuantizationType as T
    from gguf.quants import quantize

    if gguf_type not in GGUF_TYPES:
        raise ValueError(f"gguf_type must be one of {GGUF_TYPES}, got {gguf_type!r}")
    _check(model)
    c = model.config
    sd = {k: v.detach().float() for k, v in model.state_dict().items()}
    q_size, kv_size = c.n_heads * c.head_dim, c.kv_n_heads * c.head_dim
    named = [("token_embd.weight", sd["wte.weight"]), ("output_norm.weight", sd["norm_f.weight"])]
    if not c.tie_word_embeddings:
        named.append(("output.weight", sd["lm_head.weight"]))
    for i in range(c.n_layers):
        b = f"blocks.{i}."
        q, k, v = sd[b + "attn.Wqkv.weight"].split([q_size, kv_size, kv_size], dim=0)
        named += [(f"blk.{i}.attn_norm.weight", sd[b + "norm_1.weight"]),
                  (f"blk.{i}.attn_q.weight", permute(q, c.n_heads)),
                  (f"blk.{i}.attn_k.weight", permute(k, c.kv_n_heads)),
                  (f"blk.{i}.attn_v.weight", v),
                  (f"blk.{i}.attn_output.weight", sd[b + "attn.out_proj.weight"]),
                  (f"blk.{i}.ffn_norm.weight", sd[b + "norm_2.weight"]),
                  (f"blk.{i}.ffn_gate.weight", sd[b + "ffn.gate_proj.weight"]),
                  (f"blk.{i}.ffn_up.weight", sd[b + "ffn.up_proj.weight"]),
                  (f"blk.{i}.ffn_down.weight", sd[b + "ffn.down_proj.weight"])]
    out = []
    for name, tensor in named:
        data = tensor.contiguous().numpy().astype(np.float32)
        qtype = T.F32
        if data.ndim == 2 and gguf_type != "f32":
            qtype = {"f16": T.F16, "q8_0": T.Q8_0, "q4_0": T.Q4_0, "q4_1": T.Q4_1}[gguf_type]
            if gguf_type in ("q4_0", "q4_1") and name in ("token_embd.weight", "output.weight"):
                qtype = T.Q8_0
            if qtype in (T.Q8_0, T.Q4_0, T.Q4_1) and data.shape[1] % 32:
                qtype = T.F16
        if qtype == T.F16:
            data = data.astype(np.float16)
        elif qtype != T.F32:
            data = quantize(data, qtype)
        out.append((name, data, qtype))
    return out


def _pre_tokenizer_name(spec: dict | None) -> str:
    """llama.cpp's ``tokenizer.ggml.pre`` for a byte-level BPE pre-tokenizer (tokenizers' JSON)."""
    steps = (spec or {}).get("pretokenizers") if (spec or {}).get("type") == "Sequence" else [spec]
    kinds = [s.get("type") if s else None for s in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"  # llama.cpp's name (llama-vocab.cpp); "gpt2" is refused there
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and steps[1].get("use_regex", True):
        return "smollm"
    if (kinds == ["Split", "ByteLevel"] and steps[0].get("pattern", {}).get("Regex") == _LLAMA3_SPLIT
            and not steps[1].get("use_regex", True)):
        return "llama-bpe"
    raise ValueError(f"this tokenizer's pre-tokenizer ({json.dumps(spec)[:200]}) has no llama.cpp name: GGUF "
                     "export supports GPT-2's byte-level regex, SmolLM's (digits split first) and Llama 3's")


def _add_tokenizer(writer, tokenizer, vocab_size: int) -> None:
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    model = spec["model"]
    if model.get("type") != "BPE" or (spec.get("decoder") or {}).get("type") != "ByteLevel":
        raise ValueError(f"GGUF export supports byte-level BPE tokenizers; this one is {model.get('type')} with "
                         f"a {(spec.get('decoder') or {}).get('type')} decoder (a character-level tokenizer has "
                         "no llama.cpp equivalent)")
    pre = _pre_tokenizer_name(spec.get("pre_tokenizer"))
    tokens: dict[int, str] = {i: t for t, i in model["vocab"].items()}
    types = {i: _NORMAL for i in tokens}
    for added in spec.get("added_tokens", []):
        tokens[added["id"]] = added["content"]
        types[added["id"]] = _CONTROL if added.get("special") else _USER_DEFINED
    if tokens and max(tokens) >= vocab_size:
        raise ValueError(f"the tokenizer has token id {max(tokens)}, outside the model's vocabulary of {vocab_size}")
    names = [tokens.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    kinds = [types.get(i, _UNUSED) for i in range(vocab_size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(names)
    writer.add_token_types(kinds)
    writer.add_token_merges(merges)
    steps = spec["pre_tokenizer"].get("pretokenizers") or [spec["pre_tokenizer"]]
    writer.add_add_space_prefix(bool(steps[-1].get("add_prefix_space", False)))
    for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                     ("unk_token_id", writer.add_unk_token_id), ("pad_token_id", writer.add_pad_token_id)):
        if getattr(tokenizer, key) is not None:
            add(getattr(tokenizer, key))
    bos = tokenizer.bos_token_id
    writer.add_add_bos_token(bos is not None and tokenizer("a", add_special_tokens=True).input_ids[:1] == [bos])
    if getattr(tokenizer, "chat_template", None):
        writer.add_chat_template(tokenizer.chat_template)


def _is_gguf(path: Path) -> bool:
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


def save_gguf(model, tokenizer, path: str | os.PathLike, gguf_type: str = "f32", *, name: str | None = None,
              overwrite: bool = False) -> Path:
    """Write ``model`` and ``tokenizer`` as a GGUF file that llama.cpp loads.

    Args:
        model: a float :class:`~llm.model.MosaicGPT` of the llama architecture (rope, GLU/SiLU,
            RMSNorm, no biases).
        tokenizer: its byte-level BPE tokenizer (:func:`llm.load_tokenizer`'s).
        path: the ``.gguf`` file (written to a temporary name beside it, then renamed).
        gguf_type: one of :data:`GGUF_TYPES`.
        name: ``general.name`` (default: the file's stem).

    Raises:
        ValueError: for a model or tokenizer GGUF cannot hold as llama.cpp reads it (naming why).
        FileExistsError: if ``path`` exists and not ``overwrite``, or exists and is not a GGUF file
            (it is never deleted then).
        NotADirectoryError: if an existing parent of ``path`` is a file.
    """
    import gguf

    path = Path(path)
    check_replaceable(path, overwrite, _is_gguf, "a GGUF file")
    make_parent(path)
    tensors = gguf_tensors(model, gguf_type)
    c = model.config
    remove_stale_siblings(path)
    tmp = fresh_sibling(path, "tmp")
    writer = gguf.GGUFWriter(str(tmp), "llama")
    try:
        writer.add_name(name or path.stem)
        writer.add_context_length(c.max_seq_len)
        writer.add_embedding_length(c.d_model)
        writer.add_block_count(c.n_layers)
        writer.add_feed_forward_length(model.state_dict()["blocks.0.ffn.up_proj.weight"].shape[0])
        writer.add_head_count(c.n_heads)
        writer.add_head_count_kv(c.kv_n_heads)
        writer.add_rope_freq_base(c.rope_theta)
        writer.add_layer_norm_rms_eps(c.layer_norm_epsilon)
        writer.add_rope_dimension_count(c.head_dim)
        writer.add_vocab_size(c.vocab_size)
        file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                     "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
                     "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1}[gguf_type]
        writer.add_file_type(file_type)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        _add_tokenizer(writer, tokenizer, c.vocab_size)
        for tensor_name, data, qtype in tensors:
            writer.add_tensor(tensor_name, data, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, path)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return path
