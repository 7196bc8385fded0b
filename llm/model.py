"""MosaicGPT: a decoder-only transformer (GPT-2 / MPT / Llama family) with a cache-aware forward."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from llm.cache import Cache, DynamicCache
from llm.config import MosaicGPTConfig
from llm.generation import generate, stream
from llm.io import atomic_write, shape_mismatches
from llm.layers.blocks import MosaicGPTBlock
from llm.layers.linear import Linear, linear
from llm.layers.norm import build_norm
from llm.layers.positions import RotaryEmbedding, alibi_bias, alibi_slopes, position_ids_from_mask

CONFIG_FILE = "config.yaml"
WEIGHTS_FILE = "model.safetensors"


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


class MosaicGPT(nn.Module):
    """A MosaicGPT decoder-only transformer (after llm-foundry's MPT and nanoGPT's GPT).

    Its forward accepts any number of new tokens on top of a KV cache (prefill, one token,
    speculative chunks), ``inputs_embeds`` instead of ``input_ids``, and left-padded batches,
    and always equals the uncached forward of the whole sequence.
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
        self.apply(self._init_weights)
        # GPT-2's scaled init of the projections into the residual stream (Radford et al. 2019).
        for name, param in self.named_parameters():
            if name.endswith(("out_proj.weight", "down_proj.weight")):
                nn.init.normal_(param, mean=0.0, std=config.init_std / math.sqrt(2 * config.n_layers))

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
        return self.wte.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.wte.weight.dtype

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Number of parameters (tied weights counted once)."""
        n = sum(p.numel() for p in self.parameters())
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
            ValueError: both or neither of input_ids / inputs_embeds; a mask or position shape
                that does not match; a cache that does not fit the model or input (layers,
                batch size, heads, head size, dtype, static room); with learned positions,
                cached + new positions beyond max_seq_len.
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if input_ids is not None:
            if input_ids.dim() != 2:
                raise ValueError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
            x = self.wte(input_ids)
        else:
            if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != self.config.d_model:
                raise ValueError(
                    f"inputs_embeds must be (batch, seq, d_model={self.config.d_model}), "
                    f"got shape {tuple(inputs_embeds.shape)}"
                )
            x = inputs_embeds.to(self.dtype)
        batch, seq = x.shape[:2]

        legacy = isinstance(past_key_values, (tuple, list))
        cache = Cache.from_legacy(past_key_values) if legacy else past_key_values
        if cache is None and use_cache:
            cache = DynamicCache()
        if cache is not None and not isinstance(cache, Cache):
            raise ValueError(
                f"past_key_values must be an llm.Cache or a tuple of (key, value) per layer, got {type(cache).__name__}"
            )
        past = cache.get_seq_length() if cache is not None else 0
        if cache is not None:
            cache.validate(self.config, batch, seq, self.dtype)
        total = past + seq
        if self.wpe is not None and total > self.config.max_seq_len:
            raise ValueError(
                f"sequence too long: {past} cached + {seq} new positions = {total} > "
                f"max_seq_len={self.config.max_seq_len} (learned position embeddings)"
            )

        if attention_mask is not None:
            if tuple(attention_mask.shape) != (batch, total):
                raise ValueError(
                    f"attention_mask must cover the cached and the new positions: expected shape "
                    f"({batch}, {past} + {seq}), got {tuple(attention_mask.shape)}"
                )
            attention_mask = attention_mask.to(device=x.device, dtype=torch.bool)
            if bool(attention_mask.all()):
                attention_mask = None  # no padding: take the unmasked fast paths

        rotary = None
        if self.wpe is not None or self.rotary is not None:
            if position_ids is None:
                position_ids = position_ids_from_mask(attention_mask, past, seq, x.device)
            elif position_ids.dim() != 2 or position_ids.shape[-1] != seq or position_ids.shape[0] not in (1, batch):
                raise ValueError(
                    f"position_ids must be (batch or 1, seq) = ({batch}, {seq}), got {tuple(position_ids.shape)}"
                )
            if self.wpe is not None:
                if int(position_ids.max()) >= self.config.max_seq_len:
                    raise ValueError(
                        f"position {int(position_ids.max())} is beyond max_seq_len={self.config.max_seq_len}"
                    )
                x = x + self.wpe(position_ids)
            else:
                rotary = self.rotary(position_ids, x.dtype)
        x = self.emb_drop(x)

        attn_bias = None
        if self.config.alibi:
            slopes = alibi_slopes(self.config.n_heads, self.config.alibi_bias_max, device=x.device)
            if attention_mask is None:
                key_positions = torch.arange(total, device=x.device)[None]
            else:
                key_positions = attention_mask.long().cumsum(-1)
            attn_bias = alibi_bias(slopes, key_positions, x.dtype)
        query_padding_mask = attention_mask[:, -seq:] if attention_mask is not None else None
        for block in self.blocks:
            x = block(
                x, past_key_values=cache, attn_bias=attn_bias, key_padding_mask=attention_mask,
                query_padding_mask=query_padding_mask, rotary=rotary,
            )
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        x = self.norm_f(x)
        logits = self.lm_head(x) if self.lm_head is not None else linear(x, self.wte.weight)
        if legacy:
            cache = cache.to_legacy()
        return CausalLMOutput(logits=logits, past_key_values=cache)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor | None = None, **kwargs):
        """Decode new tokens; see :func:`llm.generation.generate` for every argument."""
        return generate(self, input_ids, **kwargs)

    @torch.no_grad()
    def stream(self, input_ids: torch.Tensor | None = None, **kwargs):
        """Yield new tokens as they are decoded; see :func:`llm.generation.stream`."""
        yield from stream(self, input_ids, **kwargs)

    # -- files --------------------------------------------------------------------------------
    def save_pretrained(self, directory: str | os.PathLike, tokenizer=None) -> None:
        """Write ``config.yaml`` and ``model.safetensors`` (and the tokenizer, if given) to ``directory``.

        Each file is written to a temporary name and renamed, so a crash never leaves a half
        written file under the real name.
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        atomic_write(directory / CONFIG_FILE, self.config.save)
        atomic_write(directory / WEIGHTS_FILE, lambda path: save_file(state, path, metadata={"format": "pt"}))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(directory))

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | os.PathLike,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> "MosaicGPT":
        """Load a pretrained model, in eval mode: a directory written by :meth:`save_pretrained`,
        a Llama-architecture ``.gguf`` file (llama.cpp; dequantized, float32 unless ``dtype``), or
        a registered name (``"smollm2-135m-instruct"``, see :mod:`llm.convert.registry`).

        Raises:
            FileNotFoundError: if the directory, its config or its weights are missing, or the
                GGUF file is (for a registered name: run ``make data``).
            ValueError: if the weights are unreadable (e.g. truncated) or do not fit the config,
                naming the file and the tensors that did not fit; for a GGUF file, also an
                unsupported architecture or quantization type (see :func:`llm.convert.load_gguf`).
        """
        from llm.convert.registry import PRETRAINED, resolve  # lazy: llm.convert imports this module

        kind, directory = resolve(name_or_path)
        if kind == "gguf":
            from llm.convert.gguf import load_gguf

            return load_gguf(directory, dtype=dtype, device=device)
        if not directory.exists():
            raise FileNotFoundError(
                f"no {CONFIG_FILE} in {directory}: no such directory, .gguf file or registered model "
                f"name (registered: {sorted(PRETRAINED)})"
            )
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            if not (directory / name).is_file():
                raise FileNotFoundError(f"no {name} in {directory}: not a model saved by MosaicGPT.save_pretrained")
        config = MosaicGPTConfig.load(directory / CONFIG_FILE)
        try:
            state = load_file(str(directory / WEIGHTS_FILE))
        except Exception as err:
            raise ValueError(f"cannot read weights {directory / WEIGHTS_FILE}: {err}") from err
        with torch.device("meta"):
            model = cls(config)
        problems = shape_mismatches(model.state_dict(), state)
        if problems:
            raise ValueError(f"weights in {directory / WEIGHTS_FILE} do not fit its config: " + "; ".join(problems[:10]))
        model.load_state_dict(state, assign=True)
        return model.to(device=device, dtype=dtype).eval()
