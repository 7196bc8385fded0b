"""Multi-head attention with separate query and key padding masks, correct under a KV cache.

The generic function follows llm-foundry's ``scaled_multihead_dot_product_attention`` (MPT),
extended with a causal mask aligned to the END of the keys, so that queries which come after
cached keys see exactly the keys they would see in an uncached forward.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from llm.config import MosaicGPTConfig
from llm.kernels import cpu_quant
from llm.layers.linear import Linear

#: The longest square causal attention that a compiled graph on a CPU computes as explicit
#: products and a softmax (inductor fuses the scaling, masking, softmax and casts around them)
#: rather than through torch's CPU flash kernel, which it can only call as it is. Measured on a
#: 2-core AVX-512 EPYC, forward and backward of 4 heads of 64 over 4,096 tokens: bf16 31 against
#: 40 ms at 256 tokens (21 against 43 at 128), but 112 against 96 at 512; the default Llama-style
#: model's compiled bf16 training step, 0.45 against 0.54 s per microbatch of 16 x 256.
COMPILED_MATH_MAX_SEQ = 256


def _allowed_mask(
    seq_q: int,
    seq_k: int,
    *,
    key_padding_mask: torch.Tensor | None,
    is_causal: bool,
    device: torch.device,
) -> torch.Tensor | None:
    """Boolean (batch or 1, 1, seq_q, seq_k) mask of the keys each query may attend to, or None."""
    allowed = None
    if is_causal and seq_q > 1:
        # query i is the (seq_k - seq_q + i)-th token: it sees keys 0 .. seq_k - seq_q + i.
        q_idx = torch.arange(seq_k - seq_q, seq_k, device=device)[:, None]
        allowed = (torch.arange(seq_k, device=device)[None, :] <= q_idx)[None, None]
    if key_padding_mask is not None:
        keys = key_padding_mask[:, None, None, :].bool()
        allowed = keys if allowed is None else allowed & keys
    return allowed


def attention_heads(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    attn_bias: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    query_padding_mask: torch.Tensor | None = None,
    is_causal: bool = True,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    training: bool = False,
    impl: str = "torch",
    decode_kernel: bool = False,
) -> torch.Tensor:
    """Attention over head-split tensors; the core of :func:`scaled_multihead_dot_product_attention`.

    Args:
        query: (batch, n_heads, seq_q, head_dim).
        key, value: (batch, kv_n_heads, seq_k, head_dim); n_heads must be a multiple of
            kv_n_heads (grouped-query attention: query head h uses kv head h // group).
        softmax_scale: defaults to 1 / sqrt(head_dim).
        attn_bias: additive float bias broadcastable to (batch, n_heads, seq_q, seq_k), e.g. ALiBi.
        key_padding_mask: (batch, seq_k) bool, True for real keys.
        query_padding_mask: (batch, seq_q) bool, True for real queries; other rows come out as 0.
        is_causal: mask keys after each query, aligned to the end of the keys.
        attn_mask: instead of ``is_causal`` and ``key_padding_mask``, an explicit bool mask of the
            keys each query may attend to, broadcastable to (batch, 1, seq_q, seq_k): a static
            cache's mask over its whole buffer (causal by buffer position and key padding), as
            gpt-fast's ``mask`` argument.
        impl: ``"torch"`` (explicit matmul + fp32 softmax) or ``"sdpa"``
            (``torch.nn.functional.scaled_dot_product_attention``; on a CPU, a compiled square
            causal attention of up to :data:`COMPILED_MATH_MAX_SEQ` keys and a masked one-query
            step take the explicit products, which are faster there).
        decode_kernel: float32 queries over an ``attn_mask`` on a CPU (a step over a cache
            buffer) take
            :func:`llm.kernels.cpu_quant.decode_attention` (head_dim a multiple of 16 up to 128; needs
            our CPU kernels; not when a gradient is wanted).

    Returns:
        (batch, n_heads, seq_q, head_dim), in the dtype of ``query``. A query with no key to
        attend to (e.g. a left-padding position) gives zeros, never NaN.

    Raises:
        ValueError: on an unknown ``impl``, head counts that do not divide, or both ``attn_mask``
            and ``key_padding_mask``.
    """
    batch, n_heads, seq_q, head_dim = query.shape
    kv_heads, seq_k = key.shape[1], key.shape[2]
    if n_heads % kv_heads:
        raise ValueError(f"n_heads ({n_heads}) must be a multiple of the key heads ({kv_heads})")
    if impl not in ("torch", "sdpa"):
        raise ValueError(f"impl must be 'torch' or 'sdpa', got {impl!r}")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    if attn_mask is not None:
        if key_padding_mask is not None:
            raise ValueError("pass key_padding_mask or attn_mask, not both: attn_mask already holds the key padding")
        allowed = attn_mask
    else:
        allowed = _allowed_mask(
            seq_q, seq_k, key_padding_mask=key_padding_mask, is_causal=is_causal, device=query.device
        )
    p = dropout_p if training else 0.0
    if decode_kernel and attn_mask is not None and p == 0.0 and _decode_kernel_takes(query, key, value):
        # a decoding step over a static buffer: one pass per query and head, masked keys unread
        bias = attn_bias.expand(batch, n_heads, seq_q, seq_k) if attn_bias is not None else None
        out = cpu_quant.decode_attention(query, key, value, attn_mask.expand(batch, 1, seq_q, seq_k)[:, 0], scale, bias)
    else:
        if _explicit_is_faster(query, impl, attn_mask, key_padding_mask, attn_bias, is_causal, seq_q, seq_k):
            impl = "torch"
        if impl == "sdpa":
            causal_fast = (attn_mask is None and is_causal and seq_q == seq_k and seq_q > 1 and attn_bias is None
                           and key_padding_mask is None)
            out = _sdpa(query, key, value, None if causal_fast else allowed, attn_bias, scale, p, causal_fast)
        else:
            out = _explicit(query, key, value, allowed, attn_bias, scale, p)
        if key_padding_mask is not None or attn_mask is not None:
            # Rows that attend to nothing (all their keys padding) are zeroed, not averaged.
            out = out * allowed.any(dim=-1, keepdim=True).to(out.dtype)
    if query_padding_mask is not None:
        out = out * query_padding_mask[:, None, :, None].to(out.dtype)
    return out


def _decode_kernel_takes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether :func:`cpu_quant.decode_attention` computes this step: float32 on a CPU, head_dim a
    multiple of 16 up to 128, no gradient wanted."""
    head_dim = query.shape[-1]
    return (query.device.type == "cpu" and query.dtype == key.dtype == value.dtype == torch.float32
            and head_dim % 16 == 0 and head_dim <= 128
            and not (query.requires_grad or key.requires_grad or value.requires_grad))


def _explicit_is_faster(query, impl, attn_mask, key_padding_mask, attn_bias, is_causal, seq_q, seq_k) -> bool:
    """Whether ``sdpa`` is better served by the explicit products on a CPU."""
    if impl != "sdpa" or query.device.type != "cpu":
        return False
    if attn_mask is not None and seq_q == 1:
        # One query per row over a masked static buffer (a batch decoding step): torch's CPU
        # flash kernel takes 5-10x longer with a mask than the two explicit products.
        return True
    # a compiled training (or uncached) forward of short sequences: see COMPILED_MATH_MAX_SEQ
    return (torch.compiler.is_compiling() and is_causal and attn_mask is None and key_padding_mask is None
            and attn_bias is None and seq_q == seq_k and seq_k <= COMPILED_MATH_MAX_SEQ)


def _sdpa(query, key, value, allowed, attn_bias, scale: float, p: float, causal_fast: bool) -> torch.Tensor:
    """torch's ``scaled_dot_product_attention``: ``causal_fast`` its own causal mask; else
    ``allowed`` and ``attn_bias`` as one float mask."""
    batch, n_heads, seq_q, head_dim = query.shape
    kv_heads, seq_k = key.shape[1], key.shape[2]
    mask = None
    if allowed is not None or attn_bias is not None:
        # A float mask with a finite floor keeps fully masked rows free of NaN; half the
        # dtype's minimum leaves room for the scores so that fp16 does not overflow to -inf.
        neg = torch.finfo(query.dtype).min / 2
        bias = attn_bias.to(query.dtype) if attn_bias is not None else torch.zeros((), dtype=query.dtype, device=query.device)
        mask = bias if allowed is None else torch.where(allowed, bias, neg)
    group = n_heads // kv_heads
    # torch's CPU flash kernel has no grouped-query path (enable_gqa falls back to the slower
    # math kernel), so on the CPU the query heads of a group are folded into the query axis
    # (as the torch impl does) instead of copying the whole cache group times per layer and
    # step; a square causal prefill (is_causal) repeats the key heads instead.
    if group > 1 and query.device.type == "cpu" and not causal_fast:
        if mask is not None:
            mask = torch.broadcast_to(mask, (batch, n_heads, seq_q, seq_k)).reshape(batch, kv_heads, group * seq_q, seq_k)
        return F.scaled_dot_product_attention(
            query.reshape(batch, kv_heads, group * seq_q, head_dim), key, value, attn_mask=mask, dropout_p=p,
            scale=scale,
        ).view(batch, n_heads, seq_q, head_dim)
    gqa = group > 1
    if gqa and query.device.type == "cpu":
        key = key.repeat_interleave(group, dim=1)
        value = value.repeat_interleave(group, dim=1)
        gqa = False
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=p, is_causal=causal_fast,
                                          scale=scale, enable_gqa=gqa)


def _explicit(query, key, value, allowed, attn_bias, scale: float, p: float) -> torch.Tensor:
    """The two products and a float32 softmax, the query heads of a group folded into the query
    axis (no copy of the keys per head)."""
    batch, n_heads, seq_q, head_dim = query.shape
    kv_heads, seq_k = key.shape[1], key.shape[2]
    group = n_heads // kv_heads
    q = query.reshape(batch, kv_heads, group * seq_q, head_dim)
    scores = torch.matmul(q, key.transpose(-1, -2)).view(batch, n_heads, seq_q, seq_k)
    scores = scores.float() * scale
    if attn_bias is not None:
        scores = scores + attn_bias.float()
    if allowed is not None:
        scores = scores.masked_fill(~allowed, torch.finfo(torch.float32).min)
    probs = scores.softmax(dim=-1).to(query.dtype)
    if p > 0:
        probs = F.dropout(probs, p=p, training=True)
    out = torch.matmul(probs.view(batch, kv_heads, group * seq_q, seq_k), value)
    return out.view(batch, n_heads, seq_q, head_dim)


def scaled_multihead_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    n_heads: int,
    *,
    kv_n_heads: int | None = None,
    softmax_scale: float | None = None,
    attn_bias: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    query_padding_mask: torch.Tensor | None = None,
    is_causal: bool = True,
    dropout_p: float = 0.0,
    training: bool = False,
    impl: str = "torch",
) -> torch.Tensor:
    """Generic multi-head attention over unsplit tensors, with separate query and key padding masks.

    As llm-foundry's function of the same name (MPT), but the causal mask is aligned to the end
    of the keys: query i sees keys up to seq_k - seq_q + i, which is right when the keys hold a
    cache followed by the queries' own keys.

    Args:
        query: (batch, seq_q, n_heads * head_dim).
        key, value: (batch, seq_k, kv_n_heads * head_dim); kv_n_heads defaults to n_heads.
        n_heads: number of query heads.
        attn_bias, key_padding_mask, query_padding_mask, is_causal, softmax_scale, dropout_p,
        training, impl: as in :func:`attention_heads` (masks are bool, True for real tokens).

    Returns:
        (batch, seq_q, n_heads * head_dim). Padding query rows are zeros; no row is ever NaN
        (fully masked rows included) in fp32, fp16 or bf16.
    """
    kv_n_heads = kv_n_heads or n_heads
    q = rearrange(query, "b s (h d) -> b h s d", h=n_heads)
    k = rearrange(key, "b s (h d) -> b h s d", h=kv_n_heads)
    v = rearrange(value, "b s (h d) -> b h s d", h=kv_n_heads)
    out = attention_heads(
        q, k, v, softmax_scale=softmax_scale, attn_bias=attn_bias,
        key_padding_mask=key_padding_mask, query_padding_mask=query_padding_mask,
        is_causal=is_causal, dropout_p=dropout_p, training=training, impl=impl,
    )
    return rearrange(out, "b h s d -> b s (h d)")


class MultiheadAttention(cpu_quant.Watched, nn.Module):
    """Self-attention block layer: fused QKV projection, optional rotary positions, KV cache.

    Parameter names follow MPT: ``Wqkv`` (d_model -> (n_heads + 2 * kv_n_heads) * head_dim) and
    ``out_proj``. :attr:`decode_kernel` sends a static cache's decoding steps to
    :func:`llm.kernels.cpu_quant.decode_attention`.
    """

    def __init__(self, config: MosaicGPTConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads = config.n_heads
        self.kv_n_heads = config.kv_n_heads
        self.head_dim = config.head_dim
        self.attn_impl = config.attn_impl
        self.attn_pdrop = config.attn_pdrop
        self.qk_norm, self.qk_norm_eps = config.qk_norm, config.layer_norm_epsilon
        bias = not config.no_bias
        self.Wqkv = Linear(config.d_model, (self.n_heads + 2 * self.kv_n_heads) * self.head_dim, bias=bias)
        self.out_proj = Linear(self.n_heads * self.head_dim, config.d_model, bias=bias)

    @property
    def decode_kernel(self) -> bool:
        """Whether decoding steps take our attention kernel: when the projections do (a model
        quantized on our kernels, see ``backend`` in :mod:`llm.quant.modules`)."""
        return getattr(self.Wqkv, "kernel", None) == "llm"

    def forward(
        self,
        x: torch.Tensor,
        *,
        past_key_values=None,
        attn_bias: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        query_padding_mask: torch.Tensor | None = None,
        rotary=None,
        cache_position: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: (batch, seq, d_model) -> (batch, seq, d_model).

        ``past_key_values`` (a cache from :mod:`llm.cache`) receives this layer's new keys and
        values and returns all keys and values so far. ``rotary`` is a callable applied to the
        query and key heads (rotary position embedding) before they are cached.
        ``cache_position`` ((seq,) int64) writes the new keys at those buffer positions of a
        static cache, which returns its whole buffer; ``attn_mask`` then says which of its keys
        each query sees (see :func:`attention_heads`).
        """
        batch, seq, _ = x.shape
        qkv = self.Wqkv(x).view(batch, seq, self.n_heads + 2 * self.kv_n_heads, self.head_dim).transpose(1, 2)
        qk, v = qkv.split([self.n_heads + self.kv_n_heads, self.kv_n_heads], dim=1)
        if self.qk_norm:  # every query and key head to unit RMS, before positions (modded-nanogpt)
            qk = F.rms_norm(qk, (self.head_dim,), eps=self.qk_norm_eps)
        if rotary is not None:  # queries and keys rotated in one call
            qk = rotary(qk)
        q, k = qk.split([self.n_heads, self.kv_n_heads], dim=1)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx, cache_position)
        out = attention_heads(
            q, k, v, attn_bias=attn_bias, key_padding_mask=key_padding_mask,
            query_padding_mask=query_padding_mask, is_causal=True, attn_mask=attn_mask,
            dropout_p=self.attn_pdrop, training=self.training, impl=self.attn_impl, decode_kernel=self.decode_kernel,
        )
        return self.out_proj(out.transpose(1, 2).reshape(batch, seq, self.n_heads * self.head_dim))
