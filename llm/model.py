"""MosaicGPT: a decoder-only transformer (GPT-2 / MPT / Llama family) with a cache-aware forward."""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

from llm.bundle import from_pretrained, save_pretrained, weights_digest
from llm.cache import Cache, DynamicCache
from llm.config import FLOAT_KEYS, MosaicGPTConfig
from llm.generation import GenerationConfig, generate, stream
from llm.generation.decoding import check_token_ids
from llm.kernels import cpu_quant
from llm.layers.blocks import MosaicGPTBlock, forward_blocks
from llm.layers.linear import Linear, linear
from llm.layers.norm import build_norm
from llm.layers.positions import RotaryEmbedding, alibi_bias, alibi_slopes, position_ids_from_mask

@dataclass
class CausalLMOutput:
    """What :meth:`MosaicGPT.forward` returns.

    Attributes:
        logits: (batch, seq, vocab_size), in the model's dtype.
        past_key_values: the cache holding every position so far (a :class:`~llm.cache.Cache`,
            or legacy tuples when legacy tuples were passed in), or None without a cache.
    """

    logits: torch.Tensor
    past_key_values: Any = None


_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
                   "xavier_normal_", "ones_", "zeros_", "constant_")


def _no_init(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return tensor


class MosaicGPT(nn.Module):
    """A MosaicGPT decoder-only transformer (after llm-foundry's MPT and nanoGPT's GPT).

    Its forward accepts any number of new tokens on top of a KV cache (prefill, one token,
    speculative chunks), ``inputs_embeds`` instead of ``input_ids``, and padded batches, and
    always equals the uncached forward of the whole sequence.

    Attributes:
        generation_config: the :class:`~llm.generation.GenerationConfig` that ``generate`` and
            ``stream`` use unless given another (as transformers' ``model.generation_config``):
            the defaults, or what :meth:`from_pretrained` found for the model.
    """

    def __init__(self, config: MosaicGPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.wpe = nn.Embedding(config.max_seq_len, config.d_model) if config.learned_pos_emb else None
        self.emb_drop = nn.Dropout(config.emb_pdrop)
        self.blocks = nn.ModuleList(MosaicGPTBlock(config, i) for i in range(config.n_layers))
        self.norm_f = build_norm(config)
        self.lm_head = None if config.tie_word_embeddings else Linear(config.d_model, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta) if config.rope else None
        self.generation_config = GenerationConfig()
        #: how the weights are quantized (a :class:`~llm.quant.QuantizationReport`), None when they are not
        self.quantization = None
        # (version key of the weights, their weights_digest) once known; see identity()
        self._digest: tuple[tuple, str] | None = None
        self.apply(self._init_weights)
        # GPT-2's scaled init of the projections into the residual stream (Radford et al. 2019).
        for name, param in self.named_parameters():
            if name.endswith(("out_proj.weight", "down_proj.weight")):
                nn.init.normal_(param, mean=0.0, std=config.init_std / math.sqrt(2 * config.n_layers))

    @classmethod
    def empty(cls, config: MosaicGPTConfig) -> "MosaicGPT":
        """The model on the meta device with nothing drawn, for ``load_state_dict(..., assign=True)``.

        ``torch.nn.init``'s functions are no-ops while it is built (as transformers'
        ``no_init_weights``): on the meta device they would import sympy and dynamo, seconds
        of a model load.
        """
        saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}
        try:
            for name in saved:
                setattr(nn.init, name, _no_init)
            with torch.device("meta"):
                return cls(config)
        finally:
            for name, fn in saved.items():
                setattr(nn.init, name, fn)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.init_std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def get_input_embeddings(self) -> nn.Embedding:
        """The token embedding, (vocab_size, d_model)."""
        return self.wte

    @property
    def device(self) -> torch.device:
        return self.norm_f.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the residual stream, the norms and the KV cache (a quantized model's
        weights are stored in other dtypes)."""
        return self.norm_f.weight.dtype

    def identity(self) -> str:
        """SHA-256 (hex) of this model's config and weights: which model this is, e.g. for a saved
        KV cache to be reused by the model that made it only (:meth:`llm.cache.Cache.load`).

        The config counts without ``attn_impl`` (how attention is computed, not what); the
        weights with their dtype (:func:`weights_digest`), so a cast model is another model. The
        weights are hashed at the first call and the result remembered while every tensor of
        the state dict keeps its autograd version counter and storage, and the model stays in
        eval mode: an optimizer step, ``load_state_dict`` or a move gives a new identity.
        Entering training mode forgets it (a fused optimizer's step does not count versions);
        writes through ``param.data`` in eval mode are not seen. :meth:`from_pretrained` knows
        a bundle's digest without hashing (:meth:`save_pretrained` stores it); a GGUF model is
        hashed like a model built in memory, so it shares its identity with its saved bundle.
        """
        state = self._weights_to_save()
        key = self._weights_key(state)
        if self._digest is not None and self._digest[0] == key:
            digest = self._digest[1]
        else:
            digest = weights_digest(state)
            self._digest = None if self.training else (key, digest)
        config = {k: float(v) if k in FLOAT_KEYS else v for k, v in self.config.to_dict().items() if k != "attn_impl"}
        return hashlib.sha256(f"{json.dumps(config, sort_keys=True)}\n{digest}".encode()).hexdigest()

    @staticmethod
    def _weights_key(state: Mapping[str, torch.Tensor]) -> tuple:
        """What changes when a weight is written in place, replaced or moved."""
        # inference tensors keep no version counter; they can only be written in inference mode
        return tuple((name, -1 if t.is_inference() else t._version, t.data_ptr(), t.dtype, t.device)
                     for name, t in state.items())

    def _remember_digest(self, digest: str) -> None:
        """Take ``digest`` as the weights_digest of the weights as they are now (see :meth:`identity`)."""
        self._digest = (self._weights_key(self._weights_to_save()), digest)

    def _weights_to_save(self) -> dict[str, torch.Tensor]:
        """The state dict as :meth:`save_pretrained` writes it: a quantized output layer tied to the
        embedding shares its int8 storage, so it is written once, as ``wte.*``."""
        state = self.state_dict()
        if self.quantization is not None and self.config.tie_word_embeddings:
            state = {k: v for k, v in state.items() if not k.startswith("lm_head.")}
        return state

    def train(self, mode: bool = True) -> "MosaicGPT":
        """Set training mode (``mode``) or eval mode; training forgets the remembered weights
        digest (see :meth:`identity`)."""
        if mode:
            self._digest = None
        return super().train(mode)

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Number of parameters (tied weights counted once); a quantized weight counts its
        logical (out_features x in_features) elements, as before quantization."""
        n = sum(p.numel() for p in self.parameters())
        shared = set()
        for module in self.modules():
            weight = getattr(module, "weight", None)
            if isinstance(weight, torch.Tensor) and not isinstance(weight, nn.Parameter) and weight.data_ptr() not in shared:
                shared.add(weight.data_ptr())
                n += getattr(module, "out_features", 0) * getattr(module, "in_features", 0) or weight.numel()
                bias = getattr(module, "bias", None)
                n += bias.numel() if bias is not None else 0
        if exclude_embeddings:
            n -= self.wte.weight.numel() + (self.wpe.weight.numel() if self.wpe is not None else 0)
        return n

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        *,
        inputs_embeds: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Cache | tuple | list | None = None,
        use_cache: bool = False,
        logits_to_keep: int = 0,
    ) -> CausalLMOutput:
        """Logits of the next token at every new position.

        Args:
            input_ids: (batch, seq) int64 token ids of the NEW positions, or
            inputs_embeds: (batch, seq, d_model) their embeddings; exactly one of the two.
            attention_mask: (batch, past + seq) bool/int over the cached AND the new positions,
                1 for real tokens, 0 for padding (left padding for generation). None: all real.
            position_ids: (batch or 1, seq) int64; default: the cache length onwards, shifted by
                left padding so each row's first real token has position 0. Used by learned and
                rotary positions; ALiBi counts distances between real tokens (from attention_mask).
            past_key_values: a :class:`~llm.cache.Cache` (updated in place), or transformers'
                legacy tuple of (key, value) per layer, each (batch, kv_n_heads, past, head_dim);
                None for no cache.
            use_cache: create a :class:`~llm.cache.DynamicCache` when none is given.
            logits_to_keep: compute logits for only the last this many positions (0: all), as
                transformers; generation needs only the last, which saves the vocabulary
                projection of the rest of the prompt.

        Returns:
            :class:`CausalLMOutput` with ``logits`` (batch, seq or logits_to_keep, vocab_size) and
            ``past_key_values`` (the cache, in the format it was given; legacy tuples are
            copied, never written in place).

        Raises:
            ValueError: both or neither of input_ids / inputs_embeds; a token id outside
                [0, vocab_size) (naming it: the embedding would raise an IndexError, or index
                out of bounds on a GPU); a mask or position shape
                that does not match; a cache that does not fit the model or input (layers,
                batch size, heads, head size, dtype, static room); with learned positions,
                cached + new positions beyond max_seq_len.
        """
        x = self._embed(input_ids, inputs_embeds)
        batch, seq = x.shape[:2]
        legacy = isinstance(past_key_values, (tuple, list))
        cache = self._open_cache(Cache.from_legacy(past_key_values) if legacy else past_key_values, use_cache, x)
        past = cache.get_seq_length() if cache is not None else 0
        attention_mask = self._padding_mask(attention_mask, batch, past, seq, x.device)
        x, rotary = self._positions(x, position_ids, attention_mask, past)
        x = self.emb_drop(x)
        attn_bias = self._alibi(attention_mask, past + seq, x) if self.config.alibi else None
        plans = self._fused_weights(x) if attn_bias is None else None
        if plans is not None:
            x = self._blocks_over_buffer(x, cache if cache is not None else DynamicCache(), attention_mask, past, rotary,
                                         plans)
        else:
            query_padding_mask = attention_mask[:, -seq:] if attention_mask is not None else None
            for block in self.blocks:
                x = block(x, past_key_values=cache, attn_bias=attn_bias, key_padding_mask=attention_mask,
                          query_padding_mask=query_padding_mask, rotary=rotary)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        logits = self._logits(x, plans is not None)
        return CausalLMOutput(logits=logits, past_key_values=cache.to_legacy() if legacy else cache)

    def _embed(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None) -> torch.Tensor:
        """(batch, seq, d_model) in the model's dtype from exactly one of the two (see :meth:`forward`)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if input_ids is not None:
            if input_ids.dim() != 2:
                raise ValueError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
            check_token_ids(input_ids, self.config.vocab_size)
            return self.wte(input_ids)
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != self.config.d_model:
            raise ValueError(
                f"inputs_embeds must be (batch, seq, d_model={self.config.d_model}), "
                f"got shape {tuple(inputs_embeds.shape)}"
            )
        return inputs_embeds.to(self.dtype)

    def _open_cache(self, cache, use_cache: bool, x: torch.Tensor) -> Cache | None:
        """The cache of a forward of ``x`` (a new DynamicCache for ``use_cache``), checked to fit it."""
        if cache is None and use_cache:
            cache = DynamicCache()
        if cache is None:
            return None
        if not isinstance(cache, Cache):
            raise ValueError(
                f"past_key_values must be an llm.Cache or a tuple of (key, value) per layer, got {type(cache).__name__}"
            )
        cache.validate(self.config, x.shape[0], x.shape[1], self.dtype)
        return cache

    def _padding_mask(self, attention_mask, batch: int, past: int, seq: int, device) -> torch.Tensor | None:
        """``attention_mask`` as bool (batch, past + seq), or None where every position is real; checks
        that the sequence fits learned positions."""
        if self.wpe is not None and past + seq > self.config.max_seq_len:
            raise ValueError(
                f"sequence too long: {past} cached + {seq} new positions = {past + seq} > "
                f"max_seq_len={self.config.max_seq_len} (learned position embeddings)"
            )
        if attention_mask is None:
            return None
        if tuple(attention_mask.shape) != (batch, past + seq):
            raise ValueError(
                f"attention_mask must cover the cached and the new positions: expected shape "
                f"({batch}, {past} + {seq}), got {tuple(attention_mask.shape)}"
            )
        attention_mask = attention_mask.to(device=device, dtype=torch.bool)
        return None if bool(attention_mask.all()) else attention_mask  # no padding: the unmasked fast paths

    def _positions(self, x: torch.Tensor, position_ids, attention_mask, past: int):
        """(x with learned position embeddings added, the rotary :class:`Rotation` or None)."""
        if self.wpe is None and self.rotary is None:
            return x, None
        batch, seq = x.shape[:2]
        if position_ids is None:
            position_ids = position_ids_from_mask(attention_mask, past, seq, x.device)
        elif position_ids.dim() != 2 or position_ids.shape[-1] != seq or position_ids.shape[0] not in (1, batch):
            raise ValueError(f"position_ids must be (batch or 1, seq) = ({batch}, {seq}), got {tuple(position_ids.shape)}")
        if self.wpe is None:
            return x, self.rotary(position_ids, x.dtype)
        if int(position_ids.max()) >= self.config.max_seq_len:
            raise ValueError(f"position {int(position_ids.max())} is beyond max_seq_len={self.config.max_seq_len}")
        return x + self.wpe(position_ids), None

    def _alibi(self, attention_mask, total: int, x: torch.Tensor) -> torch.Tensor:
        """ALiBi's bias over all ``total`` keys (:func:`alibi_bias`), positions counting real tokens only."""
        slopes = alibi_slopes(self.config.n_heads, self.config.alibi_bias_max, device=x.device)
        if attention_mask is None:
            key_positions = torch.arange(total, device=x.device)[None]
        else:
            key_positions = attention_mask.long().cumsum(-1)
        return alibi_bias(slopes, key_positions, x.dtype)

    def _fused_weights(self, x: torch.Tensor) -> list | None:
        """Every block's fused kernel weights for a step of ``x``, or None unless all blocks take it."""
        plans = [b.fused_weights_for(x) if isinstance(b, MosaicGPTBlock) else None for b in self.blocks]
        return plans if all(p is not None for p in plans) else None

    def _blocks_over_buffer(self, x: torch.Tensor, cache: Cache, attention_mask: torch.Tensor | None, past: int,
                            rotary, fused: list) -> torch.Tensor:
        """The blocks as a static cache's step runs them (:meth:`forward_static`): the new keys
        written into the cache's storage at ``past`` onwards, every query over the whole buffer
        through a mask. The fused kernel's way, taken by every forward it can run, so that a
        token's logits are the same bits uncached, cached, in a prefill or a decoding step."""
        batch, seq = x.shape[:2]
        total = past + seq
        cache.reserve(self.config, batch, total, x.dtype, x.device)
        capacity = cache.storage(0)[0].shape[2]
        key_mask = torch.zeros(batch, capacity, dtype=torch.bool, device=x.device)
        key_mask[:, :total] = True if attention_mask is None else attention_mask
        cache_position = torch.arange(past, total, device=x.device)
        causal = torch.arange(capacity, device=x.device)[None, :] <= cache_position[:, None]
        x = forward_blocks(self.blocks, x, past_key_values=cache, attn_mask=(causal[None] & key_mask[:, None])[:, None],
                           rotary=rotary, cache_position=cache_position, fused=fused)
        cache.set_seq_length(total)
        return x

    def _logits(self, x: torch.Tensor, fused: bool) -> torch.Tensor:
        """The final norm and the output layer; ``fused``: the norm as the fused kernel's (each row
        summed alone, in double)."""
        if fused:
            x = cpu_quant.rms_norm(x, self.norm_f.weight, self.norm_f.eps)
        else:
            x = self.norm_f(x)
        return self.lm_head(x) if self.lm_head is not None else linear(x, self.wte.weight)

    def forward_static(
        self,
        input_ids: torch.Tensor | None,
        cache: Cache,
        cache_position: torch.Tensor,
        key_mask: torch.Tensor,
        logits_index: torch.Tensor | None = None,
        *,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits of new tokens over a static cache, with shapes that do not depend on the position.

        gpt-fast's ``Transformer.forward(idx, input_pos)``: keys are written at ``cache_position``
        and every query attends over the WHOLE buffer through a mask, so one compiled graph serves
        every position (:mod:`llm.generation.compiled`). Positions follow :meth:`forward` under
        left or inner padding (``position_ids_from_mask``'s ``cumsum(mask) - 1``; ALiBi counts
        real tokens), so the logits of real tokens equal the uncached forward's. Inference only:
        no checks, no dropout; the cache's length is not moved (the caller sets it).

        Args:
            input_ids: (batch, chunk) int64 ids of the new tokens (padding slots: any valid id), or
                None with ``inputs_embeds`` (batch, chunk, d_model).
            cache: a :class:`~llm.cache.StaticCache` with allocated storage
                (batch, kv_n_heads, capacity, head_dim).
            cache_position: (chunk,) int64 buffer positions of the new tokens.
            key_mask: (batch, capacity) bool: True where the buffer holds a real token, the new
                ones included; False for padding and for positions not yet written.
            logits_index: (batch, keep) int64 indices into the chunk of the positions to compute
                logits for; None: all.

        Returns:
            (batch, keep or chunk, vocab_size) logits in the model's dtype. A query that may see
            no key (padding) gets finite, meaningless logits.
        """
        x = self.wte(input_ids) if inputs_embeds is None else inputs_embeds.to(self.dtype)
        capacity = key_mask.shape[-1]
        counts = key_mask.long().cumsum(-1)  # (batch, capacity): real tokens up to each position
        query_counts = counts[:, cache_position]  # (batch, chunk)
        # key j is seen from buffer position p iff j <= p and j is real
        causal = torch.arange(capacity, device=x.device)[None, :] <= cache_position[:, None]
        allowed = causal[None, None] & key_mask[:, None, None, :]  # (batch, 1, chunk, capacity)
        rotary = None
        if self.wpe is not None or self.rotary is not None:
            position_ids = (query_counts - 1).clamp_min(0)
            if self.wpe is not None:
                x = x + self.wpe(position_ids)
            else:
                rotary = self.rotary(position_ids, x.dtype)
        attn_bias = None
        if self.config.alibi:
            slopes = alibi_slopes(self.config.n_heads, self.config.alibi_bias_max, device=x.device)
            # -slope * (real tokens between key and query): forward's bias up to a per-row constant
            distance = (counts[:, None, :] - query_counts[:, :, None]).to(torch.float32)
            attn_bias = (slopes[None, :, None, None] * distance[:, None]).to(x.dtype)
        x = forward_blocks(self.blocks, x, past_key_values=cache, attn_bias=attn_bias, attn_mask=allowed,
                           rotary=rotary, cache_position=cache_position)
        if logits_index is not None:
            x = x.gather(1, logits_index[:, :, None].expand(-1, -1, x.shape[-1]))
        return self._logits(x, attn_bias is None and self._fused_weights(x) is not None)

    def generate(self, input_ids: torch.Tensor | None = None, **kwargs):
        """Decode new tokens, without autograd; see :func:`llm.generation.generate` for every argument."""
        return generate(self, input_ids, **kwargs)

    def stream(self, input_ids: torch.Tensor | None = None, **kwargs):
        """Yield new tokens as they are decoded, without autograd; see :func:`llm.generation.stream`."""
        return stream(self, input_ids, **kwargs)

    # -- files --------------------------------------------------------------------------------
    def save_pretrained(self, directory: str | os.PathLike, tokenizer=None,
                        generation_config: GenerationConfig | None = None) -> None:
        """Write the model (and ``tokenizer``) to ``directory`` as a bundle: :func:`llm.bundle.save_pretrained`."""
        save_pretrained(self, directory, tokenizer, generation_config)

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike, **kwargs) -> "MosaicGPT":
        """Load a bundle, a ``.gguf`` file or a registered name, in eval mode, with ``device``,
        ``dtype``, ``quantization``, ``group_size`` and ``backend``: :func:`llm.bundle.from_pretrained`."""
        return from_pretrained(cls, name_or_path, **kwargs)
