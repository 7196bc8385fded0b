"""The blocks over a cache buffer: every query attends over the whole storage through a mask,
keys written at their buffer positions (gpt-fast's ``Transformer.forward(idx, input_pos)``).

The fused kernel runs the blocks this way, and :meth:`MosaicGPT.forward
<llm.model.MosaicGPT.forward>` takes it for every call the kernel can run, so a token's logits are
the same bits uncached, cached, in a prefill or a decoding step. :func:`forward_static` is the
same computation with shapes that do not depend on the position, for compiled decoding
(:mod:`llm.generation.compiled`) and the server's batches.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from llm.cache import Cache
from llm.kernels import cpu_quant
from llm.layers.blocks import MosaicGPTBlock, decoder_blocks, decoder_blocks_at, forward_blocks
from llm.layers.linear import linear
from llm.layers.positions import alibi_slopes
from llm.model import inputs


def masked_keys_unread(model) -> bool:
    """Whether every attention of ``model`` (a :class:`~llm.model.MosaicGPT` in eval mode) in a
    step over a cache buffer leaves the masked keys and values unread: our CPU kernels compute
    them all (the fused blocks or :func:`~llm.kernels.cpu_quant.decode_attention`, which read
    each query's allowed keys only), so the buffer needs no zeros
    (:class:`~llm.cache.StaticCache` ``zeroed=False``). False where torch's attention may run."""
    return (not model.training and model.dtype == torch.float32 and model.device.type == "cpu"
            and all(isinstance(block, MosaicGPTBlock) and block.attn.decode_kernel
                    and block.attn.head_dim % 16 == 0 and block.attn.head_dim <= 128 for block in model.blocks))


class FusedRun(NamedTuple):
    """Every block's fused kernel weights (:meth:`MosaicGPTBlock.fused_weights_for`), and, when
    the blocks share one shape, the arguments of one :func:`~llm.kernels.cpu_quant.decoder_blocks`
    call over all of them."""

    plans: list  # per block: (weights, norms, shape)
    norms: list[torch.Tensor]
    weights: list[torch.Tensor | None]
    shape: tuple | None  # (eps, n_heads, head_dim, out_features) shared by all blocks, else None


def fused_weights(model, x: torch.Tensor) -> FusedRun | None:
    """The blocks' fused kernel weights for a step of ``x``, or None unless all blocks take it.

    Kept on the model between eager calls (looking up thirty blocks' weights every decoding step
    was a tenth of a millisecond) until :func:`llm.kernels.cpu_quant.changed` says a block changed
    (which ``train()``, ``eval()`` and setting ``fused_decode`` do) or the blocks are others."""
    if x.dtype != torch.float32 or x.device.type != "cpu":
        return None
    if torch.compiler.is_compiling():  # looked up once, when traced; nothing kept
        run = _find_run(model)
    else:
        key = (cpu_quant.changes(), tuple(map(id, model.blocks)))
        kept = model.__dict__.get("_fused_run")
        if kept is None or kept[0] != key:
            kept = model.__dict__["_fused_run"] = (key, _find_run(model))  # not through __setattr__: not a module
        run = kept[1]
    if run is None or (torch.is_grad_enabled() and (x.requires_grad or any(n.requires_grad for n in run.norms))):
        return None  # the kernel records no gradient: where one is wanted, the layers run
    return run


def _find_run(model) -> FusedRun | None:
    plans = [b.enabled_fused_weights() if isinstance(b, MosaicGPTBlock) else None for b in model.blocks]
    if not all(p is not None for p in plans):
        return None
    return FusedRun(plans, [n for p in plans for n in p[1]], [w for p in plans for w in p[0]],
                    plans[0][2] if all(p[2] == plans[0][2] for p in plans) else None)


def output_logits(model, x: torch.Tensor, fused: bool) -> torch.Tensor:
    """The final norm and the output layer: (batch, seq, d_model) -> (batch, seq, vocab_size);
    ``fused``: the norm as the fused kernel's (each row summed alone, in double). With
    ``logit_softcap`` c, the logits are ``c * tanh(logits / c)`` (Gemma 2's soft-capping)."""
    if fused:
        x = cpu_quant.rms_norm(x, model.norm_f.weight, model.norm_f.eps)
    else:
        x = model.norm_f(x)
    logits = model.lm_head(x) if model.lm_head is not None else linear(x, model.wte.weight)
    cap = model.config.logit_softcap
    return logits if cap is None else cap * torch.tanh(logits / cap)


def blocks_over_buffer(model, x: torch.Tensor, cache: Cache, attention_mask: torch.Tensor | None, past: int,
                       rotary, fused: FusedRun) -> torch.Tensor:
    """The blocks on ``x`` (batch, seq, d_model) as :func:`forward_static` runs them: the new keys
    written into ``cache``'s storage (grown as needed) at ``past`` onwards, every query over the
    whole buffer through a mask; ``attention_mask``: bool (batch, past + seq) or None. Moves the
    cache's length to ``past + seq``."""
    batch, seq = x.shape[:2]
    total = past + seq
    cache.reserve(model.config, batch, total, x.dtype, x.device)
    keys, values = cache.storages()
    capacity = keys[0].shape[2]
    cache_position = torch.arange(past, total, device=x.device)
    # key j is seen from buffer position p iff j <= p (so j < total) and j is real
    mask = (torch.arange(capacity, device=x.device)[None, :] <= cache_position[:, None])[None]
    if attention_mask is not None:
        key_mask = torch.zeros(batch, capacity, dtype=torch.bool, device=x.device)
        key_mask[:, :total] = attention_mask
        mask = mask & key_mask[:, None]
    mask = mask.expand(batch, seq, capacity)
    if fused.shape is not None and all(t.dtype == torch.float32 and t.is_contiguous() for t in keys + values):
        x = decoder_blocks(fused.norms, fused.weights, fused.shape, keys, values, x, rotary, cache_position, mask)
    else:
        x = forward_blocks(model.blocks, x, past_key_values=cache, attn_mask=mask[:, None], rotary=rotary,
                           cache_position=cache_position, fused=fused.plans)
    cache.set_seq_length(total)
    return x


def forward_static(
    model,
    input_ids: torch.Tensor | None,
    cache: Cache,
    cache_position: torch.Tensor,
    key_mask: torch.Tensor,
    logits_index: torch.Tensor | None = None,
    *,
    inputs_embeds: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logits of new tokens over a static cache, with shapes that do not depend on the position.

    Keys are written at ``cache_position`` and every query attends over the WHOLE buffer through
    a mask, so one compiled graph serves every position. Positions follow
    :meth:`~llm.model.MosaicGPT.forward` under left or inner padding
    (``position_ids_from_mask``'s ``cumsum(mask) - 1``; ALiBi counts real tokens), so the
    logits of real tokens equal the uncached forward's. Inference only: no checks, no dropout;
    the cache's length is not moved (the caller sets it).

    Args:
        model: a :class:`~llm.model.MosaicGPT`.
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
    x = model.wte(input_ids) if inputs_embeds is None else inputs_embeds.to(model.dtype)
    capacity = key_mask.shape[-1]
    counts = key_mask.long().cumsum(-1)  # (batch, capacity): real tokens up to each position
    query_counts = counts[:, cache_position]  # (batch, chunk)
    # key j is seen from buffer position p iff j <= p and j is real
    causal = torch.arange(capacity, device=x.device)[None, :] <= cache_position[:, None]
    allowed = causal[None, None] & key_mask[:, None, None, :]  # (batch, 1, chunk, capacity)
    rotary = None
    if model.wpe is not None or model.rotary is not None:
        position_ids = (query_counts - 1).clamp_min(0)
        if model.wpe is not None:
            x = x + model.wpe(position_ids)
        else:
            rotary = model.rotary(position_ids, x.dtype)
    attn_bias = None
    if model.config.alibi:
        slopes = alibi_slopes(model.config.n_heads, model.config.alibi_bias_max, device=x.device)
        # -slope * (real tokens between key and query): forward's bias up to a per-row constant
        distance = (counts[:, None, :] - query_counts[:, :, None]).to(torch.float32)
        attn_bias = (slopes[None, :, None, None] * distance[:, None]).to(x.dtype)
    x = forward_blocks(model.blocks, x, past_key_values=cache, attn_bias=attn_bias, attn_mask=allowed,
                       rotary=rotary, cache_position=cache_position)
    if logits_index is not None:
        x = x.gather(1, logits_index[:, :, None].expand(-1, -1, x.shape[-1]))
    return output_logits(model, x, attn_bias is None and fused_weights(model, x) is not None)


def _runs_as_defined(module, method: str) -> bool:
    """Whether calling ``module`` runs the ``forward`` of the class that defines ``method`` and
    nothing else: no forward hooks of its own or global ones, no subclass's ``forward``. Where it
    does, a kernel may compute what the call would without making it."""
    owner = next((c for c in type(module).__mro__ if method in vars(c)), None)
    hooks = torch.nn.modules.module
    return (owner is not None and type(module).forward is owner.forward and not module._forward_hooks
            and not module._forward_pre_hooks and not hooks._global_forward_hooks
            and not hooks._global_forward_pre_hooks)


class FusedSteps:
    """One-token decoding steps of ``model`` over ``cache``, thin where the fused kernel runs them.

    A decoding step through :meth:`MosaicGPT.forward <llm.model.MosaicGPT.forward>` derives and
    checks, at every call, what does not change between steps: the cache's fit and owner, the mask
    over the buffer, the positions, the fused weights (0.2 ms of Python in a SmolLM2 step of about
    4.3; here 0.07). Here they are set up once (again when the cache's length or storage moves
    under it) and updated in place, and a step makes the same kernel calls with the same
    arguments as ``forward`` (:func:`blocks_over_buffer`, :func:`output_logits`): the same bits
    (tested). Where the fused blocks do not run (other weights, ALiBi, a gradient wanted, a
    learned position past ``max_seq_len``, a new position that is padding), a step is
    ``forward`` itself, errors included. The cache is checked and claimed (:meth:`~llm.cache.Cache.claim`)
    when the steps are set up (again whenever the cache, the batch or the mask's earlier columns
    are not what the last step left), not at every step: weights written in place between two
    steps go unnoticed.

    Args:
        model: a :class:`~llm.model.MosaicGPT`.
        cache: the :class:`~llm.cache.Cache` that ``forward`` would take as ``past_key_values``.
    """

    def __init__(self, model, cache: Cache):
        self.model, self.cache = model, cache
        self._past = None  # the cache length the key mask below is set up for; None: set it up again
        self._keys = self._values = None

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The next token's logits after ``input_ids``: (batch, 1) int64 ids of valid tokens ->
        (batch, vocab_size) logits, the cache one position longer. ``attention_mask``: bool
        (batch, past + 1) over the cached and the new position (padding: 0), or None for no
        padding, as ``forward`` takes it.

        Raises:
            ValueError: what ``forward`` raises for these arguments.
        """
        model, cache = self.model, self.cache
        past = cache.get_seq_length()
        x = inputs.embed(model, input_ids, None)  # forward's checks of the ids
        run = fused_weights(model, x)
        mask = attention_mask.to(torch.bool) if attention_mask is not None else None
        if (run is None or run.shape is None or model.config.alibi or input_ids.shape[1] != 1
                or (model.wpe is not None and past + 1 > model.config.max_seq_len)
                or (mask is not None and (tuple(mask.shape) != (x.shape[0], past + 1) or not bool(mask[:, -1].all())))):
            return self._forward(input_ids, attention_mask)
        if not self._ready(x, past, mask, 1):  # storage the kernel does not take
            return self._forward(input_ids, attention_mask)
        self._key_mask[:, 0, past] = True
        cache_position = self._buffer_positions[past:past + 1]
        position_ids = cache_position[None] if self._shift is None else self._shift + past
        cos = sin = None
        if model.rotary is not None:
            cos, sin = model.rotary.table_rows(position_ids, past)
        elif model.wpe is not None:
            x = x + model.wpe(position_ids)
        x = decoder_blocks_at(run.norms, run.weights, run.shape, self._keys, self._values, x, cos, sin,
                              cache_position, self._key_mask)
        cache.set_seq_length(past + 1)
        self._past = past + 1
        return output_logits(model, x, True)[:, -1]

    def tokens(self, token: int, steps: int, eos: tuple[int, ...], sampling: tuple[float, int, float, float] | None = None,
               uniforms: torch.Tensor | None = None) -> torch.Tensor | None:
        """Up to ``steps`` new tokens of one unpadded row after ``token`` (the last one emitted, not
        yet in the cache), each fed back, in one call of :func:`~llm.kernels.cpu_quant.decode_tokens`:
        the tokens that as many calls of this object and picks give (the same operators on the same
        arguments), stopping after an id in ``eos``; the cache is as many positions longer.
        ``sampling``: (temperature, top_k, top_p, min_p) as ``llm::sample_row`` takes them, with
        ``uniforms`` float64 (steps,) its draws; None for greedy (argmax).

        Returns int64 (n,), or None, with nothing done, where that call does not run the model:
        what :meth:`__call__` runs on other paths, a batch or padding, learned positions, soft-capped
        logits, an embedding or output layer off our kernels, or one whose call would run more
        than its kernel (forward hooks, a subclass's ``forward``).
        """
        model = self.model
        head = model.lm_head.kernel_tensors() if _runs_as_defined(model.lm_head, "kernel_tensors") else None
        lookup = getattr(model.wte, "kernel_lookup", None) if _runs_as_defined(model.wte, "kernel_lookup") else None
        embedding = lookup() if lookup is not None else (
            (model.wte.weight, None, 0) if type(model.wte) is torch.nn.Embedding and model.wte.max_norm is None
            and _runs_as_defined(model.wte, "forward") else None)
        if (head is None or embedding is None or embedding[0].dtype not in (torch.int8, torch.float32)
                or model.wpe is not None or model.config.alibi or model.config.logit_softcap is not None
                or steps < 1 or model.training):
            return None
        x = inputs.embed(model, torch.tensor([[token]], device=model.device), None)  # the step's checks of the id
        run = fused_weights(model, x)
        past = self.cache.get_seq_length()
        if run is None or run.shape is None or not self._ready(x, past, None, steps):
            return None
        rotary = model.rotary.table(past + steps - 1) if model.rotary is not None else None
        self._past = None  # set up again after an error part way, which leaves key mask columns set
        new = cpu_quant.decode_tokens(token, steps, embedding, run.norms, run.weights, run.shape, rotary, past,
                                      self._keys, self._values, past, self._key_mask, model.norm_f.weight,
                                      model.norm_f.eps, head, getattr(model.lm_head, "group_size", 0) or 0,
                                      model.config.vocab_size, eos, sampling, uniforms)
        self.cache.set_seq_length(past + len(new))
        self._past = past + len(new)
        return new

    def _ready(self, x: torch.Tensor, past: int, mask: torch.Tensor | None, new: int) -> bool:
        """Whether the kernel can take the next ``new`` positions after ``past``, with the key
        mask and storages set up again (:meth:`_set_up`) unless what the last step left still
        holds: the cache's length and storage, room for them, the batch and the mask's columns."""
        if (past != self._past or self._keys is None or past + new > self._keys[0].shape[2]
                or self.cache.storage(0)[0] is not self._keys[0] or x.shape[0] != self._key_mask.shape[0]
                or (mask is None) != (self._shift is None)
                or (mask is not None and not torch.equal(mask[:, :past], self._key_mask[:, 0, :past]))):
            self._set_up(x, past, mask, new)
        return self._keys is not None

    def _set_up(self, x: torch.Tensor, past: int, attention_mask: torch.Tensor | None, new: int) -> None:
        """Check the cache and claim it (as ``forward``), make room for ``new`` positions, and set up
        the key mask (batch, 1, capacity) of the cached real positions and each row's position shift."""
        model, cache = self.model, self.cache
        batch = x.shape[0]
        cache.validate(model.config, batch, 1, model.dtype)
        cache.claim(model)
        cache.reserve(model.config, batch, past + new, x.dtype, x.device)
        self._keys, self._values = cache.storages()
        if not all(t.dtype == torch.float32 and t.is_contiguous() for t in self._keys + self._values):
            self._keys = self._values = self._past = None
            return
        capacity = self._keys[0].shape[2]
        self._buffer_positions = torch.arange(capacity, device=x.device)
        self._key_mask = torch.zeros(batch, 1, capacity, dtype=torch.bool, device=x.device)
        if attention_mask is None:
            self._key_mask[:, 0, :past] = True
            self._shift = None
        else:
            real = attention_mask.to(device=x.device, dtype=torch.bool)[:, :past]
            self._key_mask[:, 0, :past] = real
            # forward's positions, cumsum(mask) - 1 at the new real token: the real tokens before it
            self._shift = (real.sum(-1, keepdim=True) - past)
        self._past = past

    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        self._past = None  # the cache moves without the key mask: set it up again at the next fused step
        out = self.model(input_ids, attention_mask=attention_mask, past_key_values=self.cache, use_cache=True,
                         logits_to_keep=1)
        return out.logits[:, -1]
