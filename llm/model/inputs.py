"""The input side of :meth:`MosaicGPT.forward <llm.model.MosaicGPT.forward>`: embeddings, the
cache, the padding mask, positions and ALiBi's bias, each checked against the model with an error
that names what was wrong. Functions of the model, as gpt-fast's model code keeps its helpers
beside the module.

On the CPU a check reads its result (free there) and raises a ValueError; on an accelerator the
value checks (token ids, learned positions) are ``torch._assert_async`` on the device, and the
padding mask is taken as given, so that a decoding step never waits for the device
(``generate`` checks a prompt's ids once, with the clear error, before decoding).
"""

from __future__ import annotations

import torch

from llm.cache import Cache, DynamicCache
from llm.generation.decoding import check_token_ids
from llm.layers.positions import alibi_bias, alibi_slopes, position_ids_from_mask


def embed(model, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None) -> torch.Tensor:
    """(batch, seq, d_model) in the model's dtype from exactly one of ``input_ids`` (batch, seq)
    int64 and ``inputs_embeds`` (batch, seq, d_model).

    Raises:
        ValueError: both or neither given; a wrong shape; a token id outside [0, vocab_size).
    """
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of input_ids and inputs_embeds")
    if input_ids is not None:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
        if input_ids.device.type == "cpu" and not torch.compiler.is_compiling():
            check_token_ids(input_ids, model.config.vocab_size)
        else:  # checked on the device (reading a result back would stall every decoding step) or in
            # the compiled graph (a Python branch on a tensor would break it: `fullgraph: true`)
            vocab_size = model.config.vocab_size
            torch._assert_async(((input_ids >= 0) & (input_ids < vocab_size)).all(),
                                f"input_ids hold a token id outside [0, {vocab_size})")
        return model.wte(input_ids)
    if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != model.config.d_model:
        raise ValueError(
            f"inputs_embeds must be (batch, seq, d_model={model.config.d_model}), "
            f"got shape {tuple(inputs_embeds.shape)}"
        )
    return inputs_embeds.to(model.dtype)


def open_cache(model, cache, use_cache: bool, x: torch.Tensor) -> Cache | None:
    """The cache of a forward of ``x`` (a new :class:`DynamicCache` for ``use_cache``), checked to fit it.

    Raises:
        ValueError: ``cache`` is not a :class:`Cache`, does not fit the model or ``x``
            (:meth:`Cache.validate`), or holds another model's positions (:meth:`Cache.claim`).
    """
    if cache is None and use_cache:
        cache = DynamicCache()
    if cache is None:
        return None
    if not isinstance(cache, Cache):
        raise ValueError(
            f"past_key_values must be an llm.Cache or a tuple of (key, value) per layer, got {type(cache).__name__}"
        )
    cache.validate(model.config, x.shape[0], x.shape[1], model.dtype)
    cache.claim(model)
    return cache


def padding_mask(model, attention_mask, batch: int, past: int, seq: int, device) -> torch.Tensor | None:
    """``attention_mask`` as bool (batch, past + seq), or None where every position is real.

    Raises:
        ValueError: the mask's shape is not (batch, past + seq); with learned positions, past +
            seq beyond ``max_seq_len``.
    """
    if model.wpe is not None and past + seq > model.config.max_seq_len:
        raise ValueError(
            f"sequence too long: {past} cached + {seq} new positions = {past + seq} > "
            f"max_seq_len={model.config.max_seq_len} (learned position embeddings)"
        )
    if attention_mask is None:
        return None
    if tuple(attention_mask.shape) != (batch, past + seq):
        raise ValueError(
            f"attention_mask must cover the cached and the new positions: expected shape "
            f"({batch}, {past} + {seq}), got {tuple(attention_mask.shape)}"
        )
    attention_mask = attention_mask.to(device=device, dtype=torch.bool)
    if attention_mask.device.type != "cpu" or torch.compiler.is_compiling():
        return attention_mask  # no host sync on an accelerator, no graph break compiled: the masked path
    return None if bool(attention_mask.all()) else attention_mask  # no padding: the unmasked fast paths


def positions(model, x: torch.Tensor, position_ids, attention_mask, past: int):
    """(x with learned position embeddings added, the rotary :class:`~llm.layers.positions.Rotation`
    or None). Default ``position_ids``: ``past`` onwards, shifted by left padding
    (:func:`position_ids_from_mask`).

    Raises:
        ValueError: ``position_ids`` not (batch or 1, seq); a learned position beyond ``max_seq_len``.
    """
    if model.wpe is None and model.rotary is None:
        return x, None
    batch, seq = x.shape[:2]
    if position_ids is None:
        position_ids = position_ids_from_mask(attention_mask, past, seq, x.device)
    elif position_ids.dim() != 2 or position_ids.shape[-1] != seq or position_ids.shape[0] not in (1, batch):
        raise ValueError(f"position_ids must be (batch or 1, seq) = ({batch}, {seq}), got {tuple(position_ids.shape)}")
    if model.wpe is None:
        return x, model.rotary(position_ids, x.dtype)
    if position_ids.device.type != "cpu" or torch.compiler.is_compiling():  # no host sync, no graph break
        torch._assert_async((position_ids < model.config.max_seq_len).all(),
                            f"a position is beyond max_seq_len={model.config.max_seq_len}")
    elif int(position_ids.max()) >= model.config.max_seq_len:
        raise ValueError(f"position {int(position_ids.max())} is beyond max_seq_len={model.config.max_seq_len}")
    return x + model.wpe(position_ids), None


def alibi(model, attention_mask, total: int, x: torch.Tensor) -> torch.Tensor:
    """ALiBi's bias (batch or 1, n_heads, 1, total) over all ``total`` keys (:func:`alibi_bias`),
    positions counting real tokens only."""
    slopes = alibi_slopes(model.config.n_heads, model.config.alibi_bias_max, device=x.device)
    if attention_mask is None:
        key_positions = torch.arange(total, device=x.device)[None]
    else:
        key_positions = attention_mask.long().cumsum(-1)
    return alibi_bias(slopes, key_positions, x.dtype)
