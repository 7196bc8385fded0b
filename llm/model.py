"""MosaicGPT: a decoder-only transformer (GPT-2 / MPT / Llama family) with a cache-aware forward."""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from llm.cache import Cache, DynamicCache
from llm.config import FLOAT_KEYS, MosaicGPTConfig
from llm.generation import GENERATION_CONFIG_FILE, GenerationConfig, generate, stream
from llm.generation.config import load_generation_config
from llm.generation.decoding import check_token_ids
from llm.io import atomic_write, shape_mismatches
from llm.kernels import cpu_quant
from llm.layers.blocks import MosaicGPTBlock, forward_blocks
from llm.layers.linear import Linear, linear
from llm.layers.norm import build_norm
from llm.layers.positions import RotaryEmbedding, alibi_bias, alibi_slopes, position_ids_from_mask
from llm.quant import METHODS, QUANTIZATION_FILE, quantize, quantize_like
from llm.quant.quantize import EMBEDDING, HEAD, check_backend, projections
from llm.utils.pretrained import PRETRAINED, resolve

CONFIG_FILE = "config.yaml"
WEIGHTS_FILE = "model.safetensors"
#: Loaders of the files that are not bundles, by the kind :func:`llm.utils.pretrained.resolve` gives
#: (``"gguf"``): :mod:`llm.formats` builds these models, so it registers its loaders here rather
#: than this module importing it (``import llm`` does that).
LOADERS: dict[str, Callable[..., "MosaicGPT"]] = {}
#: Key of ``model.safetensors``' metadata holding :func:`weights_digest` of the tensors written.
WEIGHTS_DIGEST_KEY = "llm.weights_sha256"


def weights_digest(state: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 (hex) of a state dict: every tensor's name, dtype, shape and bytes, in key order.

    Costs a pass over the weights, on the CPU: about a second for SmolLM2-135M's 540 MB of float32 here.
    """
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach()
        digest.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}\n".encode())
        digest.update(tensor.cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


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
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if input_ids is not None:
            if input_ids.dim() != 2:
                raise ValueError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
            check_token_ids(input_ids, self.config.vocab_size)
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
        plans = self._fused_weights(x) if attn_bias is None else None
        fused = plans is not None
        if fused:
            x = self._blocks_over_buffer(x, cache if cache is not None else DynamicCache(), attention_mask, past, rotary,
                                         plans)
        else:
            query_padding_mask = attention_mask[:, -seq:] if attention_mask is not None else None
            for block in self.blocks:
                x = block(
                    x, past_key_values=cache, attn_bias=attn_bias, key_padding_mask=attention_mask,
                    query_padding_mask=query_padding_mask, rotary=rotary,
                )
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        logits = self._logits(x, fused)
        if legacy:
            cache = cache.to_legacy()
        return CausalLMOutput(logits=logits, past_key_values=cache)

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
        """Write ``config.yaml`` and ``model.safetensors`` (and the tokenizer, if given) to ``directory``.

        A quantized model (:func:`llm.quant.quantize`) writes its quantized tensors (int4 codes
        unpacked, one uint8 per weight: the packed layout depends on the CPU) and
        ``quantization.json``, which :meth:`from_pretrained` reads to rebuild the same modules.

        ``generation_config`` (default: ``self.generation_config``) goes to
        ``generation_config.json`` unless it is all defaults, in which case an older such file is
        removed, so that the folder's generation defaults are always this model's. Each file is
        written to a temporary name and renamed, so a crash never leaves a half written file under
        the real name. The weights' metadata holds their :func:`weights_digest` (hashed from the
        very tensors written), from which :meth:`from_pretrained` knows the :meth:`identity`.
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous() for k, v in self._weights_to_save().items()}
        metadata = {"format": "pt", WEIGHTS_DIGEST_KEY: weights_digest(state)}
        atomic_write(directory / CONFIG_FILE, self.config.save)
        atomic_write(directory / WEIGHTS_FILE, lambda path: save_file(state, path, metadata=metadata))
        if self.quantization is not None:
            text = json.dumps(self.quantization.to_dict(), indent=2) + "\n"
            atomic_write(directory / QUANTIZATION_FILE, lambda path: Path(path).write_text(text))
        else:
            (directory / QUANTIZATION_FILE).unlink(missing_ok=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(directory))
        generation_config = generation_config if generation_config is not None else self.generation_config
        if generation_config != GenerationConfig():
            generation_config.to_json_file(directory / GENERATION_CONFIG_FILE)
        else:
            (directory / GENERATION_CONFIG_FILE).unlink(missing_ok=True)

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | os.PathLike,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        quantization: str | None = None,
        group_size: int = 32,
        backend: str = "auto",
    ) -> "MosaicGPT":
        """Load a pretrained model, in eval mode: a directory written by :meth:`save_pretrained`,
        a Llama-architecture ``.gguf`` file (llama.cpp; dequantized, float32 unless ``dtype``), or
        a registered name (``"smollm2-135m-instruct"``, see :mod:`llm.utils.pretrained`).
        ``generation_config`` is the directory's ``generation_config.json`` if it has one, the
        registered model's recommended settings (``GENERATION_DEFAULTS``), else the defaults.

        Args:
            quantization: None: the weights as stored (a quantized bundle loads quantized, a
                quantized GGUF file on its own blocks as with ``"gguf"``, anything else in floating
                point); ``"none"``: a GGUF file dequantized to floating point, a bundle as stored;
                ``"int8"`` / ``"int4"``: quantize while loading (:func:`llm.quant.quantize`), one
                tensor at a time, so the float model is never held whole; ``"gguf"``: keep a GGUF
                file's own quantization (:func:`llm.formats.gguf.load_gguf`: Q4_0 / Q4_1 blocks
                become int4 groups of 32 without requantizing).
            group_size: int4 group size for ``quantization="int4"``.
            backend: whose kernels quantized layers take: ``"auto"`` (ours where they run, see
                :func:`llm.quant.quantize`), ``"llm"`` or ``"torch"``.

        Raises:
            FileNotFoundError: if the directory, its config or its weights are missing, or the
                GGUF file is (for a registered name: run ``make data``).
            ValueError: if the weights are unreadable (e.g. truncated) or do not fit the config,
                naming the file and the tensors that did not fit; if ``generation_config.json``
                is not a valid generation config (naming it); an unknown ``quantization``, or one
                that contradicts a quantized bundle's, or ``"gguf"`` for a bundle; a bad
                ``backend`` (or ``"llm"`` where our kernels cannot run); for a GGUF
                file, also an unsupported architecture or quantization type (see
                :func:`llm.formats.load_gguf`).
        """
        if quantization is not None and quantization not in ("none", *METHODS, "gguf"):
            raise ValueError(f"quantization must be one of {('none', *METHODS, 'gguf')}, got {quantization!r}")
        check_backend(backend, device or "cpu")
        kind, directory = resolve(name_or_path)
        if kind in LOADERS:
            model = LOADERS[kind](directory, dtype=dtype, device=device, quantization=quantization,
                                  group_size=group_size, backend=backend)
            model.generation_config = load_generation_config(name_or_path) or GenerationConfig()
            return model
        if not directory.exists():
            raise FileNotFoundError(
                f"no {CONFIG_FILE} in {directory}: no such directory, .gguf file or registered model "
                f"name (registered: {sorted(PRETRAINED)})"
            )
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            if not (directory / name).is_file():
                raise FileNotFoundError(f"no {name} in {directory}: not a model saved by MosaicGPT.save_pretrained")
        config = MosaicGPTConfig.load(directory / CONFIG_FILE)
        saved = _read_quantization(directory)
        quantization = None if quantization == "none" else quantization
        if quantization == "gguf":
            raise ValueError(f'quantization="gguf" keeps a GGUF file\'s own quantization; {directory} is a bundle: '
                             f'load a .gguf file, or quantize the bundle with "int8" or "int4"')
        if saved is not None and quantization not in (None, saved.get("method")):
            raise ValueError(f"{directory} holds {saved.get('method')} weights; load it with quantization=\"none\" "
                             f"(requantizing {saved.get('method')} weights as {quantization} is not supported)")
        weights_path = directory / WEIGHTS_FILE
        model = cls.empty(config)
        try:
            with safe_open(str(weights_path), framework="pt") as weights:
                stored_digest = (weights.metadata() or {}).get(WEIGHTS_DIGEST_KEY)
                names = set(weights.keys())
                if saved is None and quantization is None:
                    state = {name: weights.get_tensor(name) for name in names}
                    problems = shape_mismatches(model.state_dict(), state)
                    if problems:
                        raise ValueError(f"weights in {weights_path} do not fit its config: " + "; ".join(problems[:10]))
                    model.load_state_dict(state, assign=True)
                else:
                    model = _load_quantized(model, weights, names, saved, quantization, group_size, weights_path,
                                            backend)
        except ValueError:
            raise
        except Exception as err:
            raise ValueError(f"cannot read weights {weights_path}: {err}") from err
        model.generation_config = load_generation_config(directory) or GenerationConfig()
        model = model.to(device=device, dtype=dtype).eval()
        # the stored digest is of the file's tensors: it stands for the model's unless dtype cast
        # them or they were quantized while loading (an older bundle has none: identity() hashes
        # the weights when first asked)
        if stored_digest is not None and quantization is None and dtype is None:
            model._remember_digest(stored_digest)
        return model


def _read_quantization(directory: Path) -> dict | None:
    """The bundle's ``quantization.json``, or None; ValueError if it is not a JSON object."""
    path = directory / QUANTIZATION_FILE
    if not path.is_file():
        return None
    try:
        spec = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot read {path}: {err}") from err
    if not isinstance(spec, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(spec).__name__}")
    return spec


def _load_quantized(model, weights, names, saved, method, group_size, path, backend):
    """Fill the meta ``model`` from an open safetensors file: a saved quantized model
    (``saved``, its quantization.json) or float weights quantized one tensor at a time."""
    if saved is not None:
        owned = {f"{m}.{t}" for m in saved.get("quantized", []) for t in ("weight", "scales", "scales_and_zeros", "bias")}
        if EMBEDDING in saved.get("quantized", []):
            owned |= {f"{HEAD}.weight", f"{HEAD}.scales"}
    else:
        tied = model.lm_head is None
        owned = {f"{name}.weight" for name in projections(model)} | {f"{EMBEDDING if tied else HEAD}.weight"}
    plain = {name: weights.get_tensor(name) for name in names - owned}
    expected = {k: v for k, v in model.state_dict().items() if k not in owned}
    problems = shape_mismatches(expected, plain)
    if problems:
        raise ValueError(f"weights in {path} do not fit its config: " + "; ".join(problems[:10]))
    model.load_state_dict(plain, strict=False, assign=True)

    def tensor(name: str) -> torch.Tensor:
        if name not in names:
            raise ValueError(f"weights in {path} lack {name}")
        return weights.get_tensor(name)

    if saved is not None:
        try:
            quantize_like(model, saved, tensor, backend)
        except ValueError as err:
            raise ValueError(f"weights in {path} do not fit its quantization.json: {err}") from err
    else:
        quantize(model, method, group_size, weights=tensor, backend=backend)
    left = [k for k, v in model.state_dict().items() if v.device.type == "meta"]
    if left:
        raise ValueError(f"weights in {path} lack {left[:10]}")
    return model
