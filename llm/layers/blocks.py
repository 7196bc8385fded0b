"""The pre-norm transformer block of GPT-2 / MPT / Llama."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from llm.config import MosaicGPTConfig
from llm.kernels import cpu_quant
from llm.layers.attention import MultiheadAttention
from llm.layers.ffn import GLU, build_ffn
from llm.layers.norm import RMSNorm, build_norm


class MosaicGPTBlock(cpu_quant.Watched, nn.Module):
    """``x + attn(norm_1(x))`` then ``x + ffn(norm_2(x))``, with residual dropout.

    (batch, seq, d_model) -> (batch, seq, d_model); keyword arguments go to the attention.

    A step over a cache buffer (float32 on the CPU, no gradient, a mask and ``cache_position``)
    goes to :func:`llm.kernels.cpu_quant.decoder_blocks` when the block is Llama's (RMSNorm, rotary
    or no positions, SiLU-gated FFN, no biases, no QK-norm; head_dim a multiple of 16 up to 128) and its five
    projections are quantized on our kernels, unless ``fused_decode`` is False (tests compare the
    two); any other block or step takes the layers one by one. :func:`forward_blocks` runs
    consecutive such blocks in one call.
    """

    def __init__(self, config: MosaicGPTConfig, layer_idx: int):
        super().__init__()
        self.norm_1 = build_norm(config)
        self.attn = MultiheadAttention(config, layer_idx)
        self.norm_2 = build_norm(config)
        self.ffn = build_ffn(config)
        self.resid_drop = nn.Dropout(config.resid_pdrop)
        self.fused_decode = True
        self._fused_cache: tuple[int, tuple | None] | None = None

    def forward(self, x: torch.Tensor, **attn_kwargs) -> torch.Tensor:
        parts = self._fused_parts(x, **attn_kwargs)
        if parts is not None:
            return _decoder_blocks([parts], x, attn_kwargs.get("rotary"), attn_kwargs["cache_position"],
                                   attn_kwargs["attn_mask"])
        return self.forward_layers(x, **attn_kwargs)

    def forward_layers(self, x: torch.Tensor, **attn_kwargs) -> torch.Tensor:
        """The block's layers one by one (never the fused kernel)."""
        x = x + self.resid_drop(self.attn(self.norm_1(x), **attn_kwargs))
        return x + self.resid_drop(self.ffn(self.norm_2(x)))

    def _fused_weights(self) -> tuple[list, list, tuple] | None:
        """The fused kernel's weights, norm weights and the shape that blocks in one call share
        (eps, n_heads, head_dim, out_features), or None if this block cannot take it.

        Kept between eager calls (looking them up took a sizeable share of a decoding step) until
        :func:`llm.kernels.cpu_quant.changed` says a module they come from has changed: a module
        swapped, a norm weight replaced, or a quantized layer's kernel tensors remade (a load, a
        move, a cast). A compiled graph looks them up once, when traced."""
        if torch.compiler.is_compiling():
            return self._find_fused_weights()
        version = cpu_quant.changes()
        if self._fused_cache is None or self._fused_cache[0] != version:
            # not through __setattr__, which would call changed() itself
            self.__dict__["_fused_cache"] = (version, self._find_fused_weights())
        return self._fused_cache[1]

    def _find_fused_weights(self) -> tuple[list, list, tuple] | None:
        attn, ffn, norm_1, norm_2 = self.attn, self.ffn, self.norm_1, self.norm_2
        layers = (attn._modules.get("Wqkv"), attn._modules.get("out_proj"), ffn._modules.get("gate_proj"),
                  ffn._modules.get("up_proj"), ffn._modules.get("down_proj"))
        if not (attn.decode_kernel and not attn.qk_norm and attn.head_dim % 16 == 0 and attn.head_dim <= 128
                and isinstance(ffn, GLU) and ffn.act is F.silu
                and isinstance(norm_1, RMSNorm) and isinstance(norm_2, RMSNorm) and norm_1.eps == norm_2.eps
                and norm_1.weight.dtype == norm_2.weight.dtype == torch.float32):
            return None
        tensors = [layer.kernel_tensors() if hasattr(layer, "kernel_tensors") else None for layer in layers]
        if any(t is None for t in tensors):
            return None
        shape = (norm_1.eps, attn.n_heads, attn.head_dim, tuple(layer.out_features for layer in layers))
        return [t for triple in tensors for t in triple], [norm_1.weight, norm_2.weight], shape

    def fused_weights_for(self, x: torch.Tensor) -> tuple[list, list, tuple] | None:
        """The fused kernel's weights (see :meth:`_fused_weights`) if a step of ``x`` over a cache buffer (a
        mask and ``cache_position``, no ALiBi bias or padding masks) would take it, else None."""
        if not (x.dtype == torch.float32 and x.device.type == "cpu"
                # the kernel records no gradient: where one is wanted, the layers run
                and not (torch.is_grad_enabled() and (x.requires_grad or self.norm_1.weight.requires_grad
                                                      or self.norm_2.weight.requires_grad))):
            return None
        return self.enabled_fused_weights()

    def enabled_fused_weights(self) -> tuple[list, list, tuple] | None:
        """:meth:`_fused_weights` unless ``fused_decode`` is off or the block is training, whatever the step."""
        return self._fused_weights() if self.fused_decode and not self.training else None

    def _fused_parts(self, x, past_key_values=None, attn_bias=None, attn_mask=None, rotary=None, cache_position=None,
                     key_padding_mask=None, query_padding_mask=None, fused=...) -> _Fused | None:
        """What the fused kernel needs of this block for this step, or None if it does not apply;
        ``fused``: :meth:`fused_weights_for` of ``x`` when the caller has it."""
        if (cache_position is None or attn_mask is None or attn_bias is not None or key_padding_mask is not None
                or query_padding_mask is not None):
            return None
        if fused is ...:
            fused = self.fused_weights_for(x)
        if fused is None:
            return None
        keys, values = past_key_values.storage(self.attn.layer_idx)
        if keys.dtype != torch.float32 or not (keys.is_contiguous() and values.is_contiguous()):
            return None
        weights, norms, shape = fused
        return _Fused(norms, weights, keys, values, shape)


class _Fused(NamedTuple):
    norms: list[torch.Tensor]
    weights: list[torch.Tensor | None]
    keys: torch.Tensor
    values: torch.Tensor
    shape: tuple  # (eps, n_heads, head_dim, out_features): blocks in one call share these


def forward_blocks(blocks, x: torch.Tensor, past_key_values=None, attn_bias=None, attn_mask=None, rotary=None,
                   cache_position=None, key_padding_mask=None, query_padding_mask=None,
                   fused: list | None = None) -> torch.Tensor:
    """``x`` through ``blocks`` (:class:`MosaicGPTBlock`) in order, with the arguments of their
    ``forward``: in a step over a cache buffer (float32 tokens on the CPU, no gradient, a mask and
    ``cache_position``, no ALiBi bias or padding masks), each run of
    consecutive blocks that :func:`llm.kernels.cpu_quant.decoder_blocks` takes goes in one call
    (one team of threads for the run, and one call from Python); any other block, or step, takes
    its layers one by one.

    Args:
        blocks: a sequence of :class:`MosaicGPTBlock`.
        x: (batch, seq, d_model) hidden states.
        fused: each block's :meth:`MosaicGPTBlock.fused_weights_for` of ``x``, when the caller
            has them (else they are looked up here).

    Returns:
        (batch, seq, d_model): the last block's output.
    """
    kwargs = dict(past_key_values=past_key_values, attn_bias=attn_bias, attn_mask=attn_mask, rotary=rotary,
                  cache_position=cache_position, key_padding_mask=key_padding_mask,
                  query_padding_mask=query_padding_mask)
    run: list[_Fused] = []
    for i, block in enumerate(blocks):
        # a wrapped block (FSDP, activation checkpointing) is called as it is
        parts = (block._fused_parts(x, **kwargs, fused=fused[i] if fused is not None else ...)
                 if isinstance(block, MosaicGPTBlock) else None)
        if run and (parts is None or parts.shape != run[0].shape):
            x, run = _decoder_blocks(run, x, rotary, cache_position, attn_mask), []
        if parts is None:
            x = block(x, **kwargs)
        else:
            run.append(parts)
    return _decoder_blocks(run, x, rotary, cache_position, attn_mask) if run else x


def _decoder_blocks(run: list[_Fused], x, rotary, cache_position, attn_mask) -> torch.Tensor:
    keys = [part.keys for part in run]
    mask = attn_mask.expand(x.shape[0], 1, x.shape[1], keys[0].shape[2])[:, 0]
    return decoder_blocks([n for part in run for n in part.norms], [w for part in run for w in part.weights],
                          run[0].shape, keys, [part.values for part in run], x, rotary, cache_position, mask)


def decoder_blocks(norms: list[torch.Tensor], weights: list, shape: tuple, keys: list[torch.Tensor],
                   values: list[torch.Tensor], x: torch.Tensor, rotary, cache_position: torch.Tensor,
                   mask: torch.Tensor) -> torch.Tensor:
    """Blocks of one ``shape`` (eps, n_heads, head_dim, out_features) in one
    :func:`llm.kernels.cpu_quant.decoder_blocks` call: ``norms`` and ``weights`` are the blocks'
    (:meth:`MosaicGPTBlock.fused_weights_for`) one after another, ``keys``/``values`` their cache
    storages; ``mask``: bool (batch, seq, capacity). (batch, seq, d_model) -> the same."""
    cos, sin = (rotary.cos[:, 0], rotary.sin[:, 0]) if rotary is not None else (None, None)
    return decoder_blocks_at(norms, weights, shape, keys, values, x, cos, sin, cache_position, mask)


def decoder_blocks_at(norms: list[torch.Tensor], weights: list, shape: tuple, keys: list[torch.Tensor],
                      values: list[torch.Tensor], x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                      cache_position: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """:func:`decoder_blocks` with the rotary angles given as they are: ``cos``, ``sin`` float32
    (batch or 1, seq, head_dim) (:class:`~llm.layers.positions.Rotation`'s, without its heads
    axis), or both None for no rotation (a decoding step's table rows need no Rotation made)."""
    eps, n_heads, head_dim, out_features = shape
    return cpu_quant.decoder_blocks(x, norms, eps, weights, list(out_features), cos, sin, keys, values,
                                    cache_position, mask, n_heads, 1.0 / math.sqrt(head_dim))
