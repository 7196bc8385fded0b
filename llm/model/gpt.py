"""MosaicGPT: a decoder-only transformer (GPT-2 / MPT / Llama family) with a cache-aware forward."""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llm.bundle import from_pretrained, model_identity, save_pretrained
from llm.cache import Cache, DynamicCache
from llm.config import MosaicGPTConfig
from llm.generation import GenerationConfig, generate, stream
from llm.layers.blocks import MosaicGPTBlock
from llm.layers.linear import Linear
from llm.layers.norm import build_norm
from llm.layers.positions import RotaryEmbedding
from llm.model import buffer, inputs


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


@contextlib.contextmanager
def no_init_weights():
    """``torch.nn.init``'s functions as no-ops inside (transformers' ``no_init_weights``): on the
    meta device they would import sympy and dynamo, seconds of a model load."""
    saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}
    try:
        for name in saved:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def _forget_weight_tensors(module, incompatible_keys) -> None:
    """load_state_dict's post hook (a module-level function, so the model pickles)."""
    module.forget_weight_tensors()


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
        #: digest of the tokenizer saved with the weights (llm.utils.tokens.tokenizer_digest), None if unknown
        self.tokenizer_digest: str | None = None
        # (version key of the weights, their weights_digest) once known: llm.bundle.model_identity
        self._digest: tuple[tuple, str] | None = None
        # every parameter and buffer, listed for weights_version; None: list them again
        self._weight_tensors: list[torch.Tensor] | None = None
        self.register_load_state_dict_post_hook(_forget_weight_tensors)
        self.apply(self._init_weights)
        # GPT-2's scaled init of the projections into the residual stream (Radford et al. 2019),
        # or zeros (zero_init_residual: modded-nanogpt's, each block starts as the identity)
        for name, param in self.named_parameters():
            if name.endswith(("out_proj.weight", "down_proj.weight")):
                if config.zero_init_residual:
                    nn.init.zeros_(param)
                else:
                    nn.init.normal_(param, mean=0.0, std=config.init_std / math.sqrt(2 * config.n_layers))

    @classmethod
    def empty(cls, config: MosaicGPTConfig) -> "MosaicGPT":
        """The model on the meta device with nothing drawn, for ``load_state_dict(..., assign=True)``."""
        with no_init_weights(), torch.device("meta"):
            return cls(config)

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
        """SHA-256 (hex) of this model's config and weights, remembered while they do not change:
        :func:`llm.bundle.model_identity`."""
        return model_identity(self)

    def weights_version(self) -> int:
        """A count that grows whenever a weight is written in place (an optimizer step,
        ``load_state_dict``, ``with torch.no_grad(): p.add_(...)``): the sum of the autograd
        version counters of every parameter and buffer. Costs one attribute read per tensor (about
        40 us for SmolLM2's 514), so a cache checks it at every forward (:meth:`llm.cache.Cache.claim`).
        Inference tensors, which keep no counter, can only be written in inference mode: not seen.
        The tensors are listed once and again after ``to()``, ``load_state_dict`` or quantization,
        which replace them.
        """
        tensors = self._weight_tensors
        if tensors is None:
            tensors = self._weight_tensors = [t for t in (*self.parameters(), *self.buffers()) if not t.is_inference()]
        return sum(t._version for t in tensors)

    def forget_weight_tensors(self) -> None:
        """List the weights again at the next :meth:`weights_version` (after modules were replaced)."""
        self._weight_tensors = None

    def _apply(self, fn, recurse: bool = True):
        self._weight_tensors = None  # to(), float(), cuda()... may give new tensors
        return super()._apply(fn, recurse)

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
                n += (getattr(module, "out_features", 0) * getattr(module, "in_features", 0)
                      or getattr(module, "num_embeddings", 0) * getattr(module, "embedding_dim", 0) or weight.numel())
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
        x = inputs.embed(self, input_ids, inputs_embeds)
        batch, seq = x.shape[:2]
        legacy = isinstance(past_key_values, (tuple, list))
        cache = inputs.open_cache(self, Cache.from_legacy(past_key_values) if legacy else past_key_values, use_cache, x)
        past = cache.get_seq_length() if cache is not None else 0
        attention_mask = inputs.padding_mask(self, attention_mask, batch, past, seq, x.device)
        x, rotary = inputs.positions(self, x, position_ids, attention_mask, past)
        x = self.emb_drop(x)
        attn_bias = inputs.alibi(self, attention_mask, past + seq, x) if self.config.alibi else None
        plans = buffer.fused_weights(self, x) if attn_bias is None else None
        if plans is not None:
            x = buffer.blocks_over_buffer(self, x, cache if cache is not None else DynamicCache(), attention_mask,
                                          past, rotary, plans)
        else:
            query_padding_mask = attention_mask[:, -seq:] if attention_mask is not None else None
            for block in self.blocks:
                x = block(x, past_key_values=cache, attn_bias=attn_bias, key_padding_mask=attention_mask,
                          query_padding_mask=query_padding_mask, rotary=rotary)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        logits = buffer.output_logits(self, x, plans is not None)
        return CausalLMOutput(logits=logits, past_key_values=cache.to_legacy() if legacy else cache)

    def decoding_steps(self, cache: Cache) -> "buffer.FusedSteps":
        """A callable for decoding one token at a time over ``cache``: ``steps(input_ids (batch,
        1), attention_mask) -> (batch, vocab_size)`` logits, as :meth:`forward` gives them, with
        less Python per step where the fused kernel runs (:class:`~llm.model.buffer.FusedSteps`)."""
        return buffer.FusedSteps(self, cache)

    def forward_static(self, input_ids: torch.Tensor | None, cache: Cache, cache_position: torch.Tensor,
                       key_mask: torch.Tensor, logits_index: torch.Tensor | None = None, *,
                       inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of new tokens over a static cache, with shapes that do not depend on the position
        (for compiled decoding and the server): :func:`llm.model.buffer.forward_static`."""
        return buffer.forward_static(self, input_ids, cache, cache_position, key_mask, logits_index,
                                     inputs_embeds=inputs_embeds)

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
