"""The compiled static-cache decode step: prefill, one-token step and draft verification with fixed shapes.

After gpt-fast (``generate.py``'s ``prefill`` / ``decode_one_token`` over ``model.py``'s
``KVCache`` written by index, attending over the whole buffer through a mask): every forward of a
generate call runs :meth:`~llm.model.MosaicGPT.forward_static` on a
:class:`~llm.cache.StaticCache`, with shapes that do not depend on the position, the prompt length
or the call, so that ``torch.compile`` compiles each of the three steps once and reuses it:

- the one-token step: (batch, 1);
- prefill: chunks of :data:`PREFILL_CHUNK` tokens, the last one padded (padded queries are
  masked; their keys land beyond the valid length, where the mask hides them until a real token
  overwrites them);
- speculative verification (the last token and a draft of varying length): one chunk of
  :func:`verify_chunk` tokens, padded likewise;
- the buffer's capacity: :func:`cache_capacity`, a power of two of at least
  :data:`MIN_CAPACITY`, so calls of different lengths share a compiled step while attention
  does not scan a much larger buffer than the call needs (one compile per capacity, batch size
  and step).

The compiled artifacts are cached on disk by inductor (FX graph and AOTAutograd caches) under
``$TORCHINDUCTOR_CACHE_DIR``, by default ``$LLM_HOME/inductor/<machine>`` (one folder per CPU model),
so a later process loads them instead of compiling. When compiling fails (no working C++
compiler), decoding warns once per process and runs the same static-cache path uncompiled.
"""

from __future__ import annotations

import warnings

import torch

from llm.cache import Cache, StaticCache
from llm.utils.home import use_inductor_cache

#: Tokens per prefill forward; a prompt takes ceil(length / PREFILL_CHUNK) forwards.
PREFILL_CHUNK = 32
#: The smallest buffer; larger ones are the next power of two of what a call needs.
MIN_CAPACITY = 256
#: torch.compile's backend; tests swap in a counting backend (torch._dynamo.testing.CompileCounterWithBackend).
COMPILE_BACKEND = "inductor"
# Compiled graphs per step function before dynamo gives up compiling (its default is 8): one per
# capacity, batch size and model shape in a long-lived process.
_RECOMPILE_LIMIT = 64

# why compiling failed in this process (then the steps run uncompiled), or None
_failure: str | None = None


def cache_capacity(needed: int) -> int:
    """Buffer positions for a call that writes up to ``needed`` positions: the next power of two
    >= ``needed``, and at least :data:`MIN_CAPACITY`."""
    return max(MIN_CAPACITY, 1 << max(needed - 1, 0).bit_length())


def verify_chunk(draft_tokens: int) -> int:
    """Tokens per verification forward for drafts of up to ``draft_tokens`` tokens: the last
    token and the draft, rounded up to a power of two of at least 8."""
    return max(8, 1 << draft_tokens.bit_length())


def prefill(model, input_ids, cache, cache_position, key_mask, logits_index):
    """One prefill chunk: (batch, PREFILL_CHUNK) ids -> (batch, 1, vocab) logits at ``logits_index``."""
    return model.forward_static(input_ids, cache, cache_position, key_mask, logits_index)


def decode_one_token(model, input_ids, cache, cache_position, key_mask):
    """One decoding step: (batch, 1) ids -> (batch, 1, vocab) logits."""
    return model.forward_static(input_ids, cache, cache_position, key_mask)


def verify(model, input_ids, cache, cache_position, key_mask):
    """The last token and a draft, padded: (batch, verify_chunk) ids -> (batch, verify_chunk, vocab) logits."""
    return model.forward_static(input_ids, cache, cache_position, key_mask)


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` with row-major strides: dynamo guards on the strides of its inputs (size-1 dimensions
    included), so a slice or a view would make one graph per prompt length or call."""
    return t.clone(memory_format=torch.contiguous_format)


def compiled_step(fn, compile: bool):
    """``fn`` (one of this module's step functions) through ``torch.compile``, or ``fn`` itself.

    The wrapper checks dynamo's guards at its first call only: make a new one whenever the model,
    the cache or a shape changes. When compiling fails it warns once per process (naming the
    cause) and every wrapper runs ``fn`` uncompiled from then on.
    """
    if not compile or _failure is not None:
        return fn
    use_inductor_cache()
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, _RECOMPILE_LIMIT)
    # Inductor's checks of every input's size and stride at every call: the guards of the first
    # call (below) have checked them, and later calls pass the same tensors.
    options = {"size_asserts": False} if COMPILE_BACKEND == "inductor" else None
    compiled = torch.compile(fn, backend=COMPILE_BACKEND, fullgraph=True, dynamic=False, options=options)
    checked = False

    def run(*args):
        global _failure
        nonlocal checked
        if _failure is None:
            try:
                if not checked:
                    # The model's weights as attributes of the graph rather than inputs: dynamo
                    # then guards the modules (their identity and attributes) instead of every
                    # weight tensor, which cost a decoding step of SmolLM2 about 2 ms in guards
                    # and input checks (tracing happens only here: later calls skip the guards).
                    with torch._dynamo.config.patch(inline_inbuilt_nn_modules=False):
                        out = compiled(*args)
                    checked = True
                    return out
                # Later calls of one wrapper pass the same model, cache and shapes, so the graph
                # that the first call's guards chose is the one: re-checking the hundreds
                # of guards on the model's modules at every step is a measurable share of it.
                with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                    return compiled(*args)
            except (torch._dynamo.exc.BackendCompilerFailed, torch._inductor.exc.InductorError) as err:
                cause = getattr(err, "inner_exception", None) or err
                _failure = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
                hint = (" compile=True needs a working C++ compiler (g++, or $CXX)."
                        if "compiler" in _failure.lower() else "")
                warnings.warn(
                    f"torch.compile failed ({_failure}); decoding runs the same static-cache path uncompiled, "
                    f"which is slower.{hint}", RuntimeWarning, stacklevel=2,
                )
        return fn(*args)

    return run


class StaticDecoder:
    """The forwards of one generate call over a :class:`~llm.cache.StaticCache`, compiled or not.

    Args:
        model: the :class:`~llm.model.MosaicGPT` (float or quantized: the step only calls its modules).
        mask: (batch, T) bool, the prompt's real tokens.
        needed: the most buffer positions the call writes (prefill chunks and verification
            padding included); the capacity is :func:`cache_capacity` of it.
        past_key_values: a cache holding the prompt's first positions, copied into the static
            buffer (it is not written), or None.
        compile: run the steps through ``torch.compile`` (else the same path uncompiled).
        draft_tokens: the longest draft to verify (0: no speculative decoding).

    Attributes:
        cache: the :class:`~llm.cache.StaticCache`; its length is the number of valid positions.
    """

    def __init__(self, model, mask: torch.Tensor, needed: int, past_key_values: Cache | None, compile: bool,
                 draft_tokens: int = 0):
        self.model = model
        batch, device = mask.shape[0], mask.device
        self.verify_len = verify_chunk(draft_tokens) if draft_tokens else 0
        capacity = cache_capacity(needed)
        self.cache = StaticCache(model.config, batch, capacity, device=device, dtype=model.dtype)
        cached = past_key_values.get_seq_length() if past_key_values is not None else 0
        for i, (k, v) in enumerate(past_key_values or ()):
            self.cache._keys[i].narrow(2, 0, cached).copy_(k)
            self.cache._values[i].narrow(2, 0, cached).copy_(v)
        self.cache.set_seq_length(cached)
        # real tokens over the whole buffer; a position becomes real when its token is fed
        self.key_mask = torch.zeros(batch, capacity, dtype=torch.bool, device=device)
        self.key_mask[:, :cached] = mask[:, :cached]
        self.steps = {f.__name__: compiled_step(f, compile) for f in (prefill, decode_one_token, verify)}

    def _feed(self, start: int, real: torch.Tensor, width: int) -> torch.Tensor:
        """Mark buffer positions start .. start + width - 1 real where ``real`` ((batch, n) bool,
        n <= width) says so, the rest padding; return their (width,) int64 positions."""
        n = real.shape[1]
        self.key_mask[:, start:start + n] = real
        self.key_mask[:, start + n:start + width] = False
        return torch.arange(start, start + width, device=self.key_mask.device)

    def prefill(self, new: torch.Tensor, mask: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """Run the prompt after the cached positions, in chunks; return each row's logits at its
        last real token.

        Args:
            new: (batch, n) int64 ids or (batch, n, d_model) embeddings of the uncached prompt
                (embeddings run uncompiled: the compiled prefill takes ids).
            mask: (batch, T) bool, the whole prompt's real tokens.
            last: (batch,) int64 prompt position of each row's last real token (>= the cache length).

        Returns:
            (batch, vocab_size) logits.
        """
        start = self.cache.get_seq_length()
        batch, n = new.shape[:2]
        logits = None
        for offset in range(0, n, PREFILL_CHUNK):
            s = start + offset
            chunk = new[:, offset:offset + PREFILL_CHUNK]
            width = chunk.shape[1]
            if width < PREFILL_CHUNK:
                chunk = torch.cat([chunk, chunk.new_zeros(batch, PREFILL_CHUNK - width, *chunk.shape[2:])], dim=1)
            chunk = _dense(chunk)
            positions = self._feed(s, mask[:, s:s + width], PREFILL_CHUNK)
            index = (last - s).clamp(0, PREFILL_CHUNK - 1)[:, None]
            if chunk.dim() == 2:
                out = self.steps["prefill"](self.model, chunk, self.cache, positions, self.key_mask, index)
            else:
                out = self.model.forward_static(None, self.cache, positions, self.key_mask, index,
                                                inputs_embeds=chunk)
            here = ((last >= s) & (last < s + width))[:, None]
            logits = out[:, 0] if logits is None else torch.where(here, out[:, 0], logits)
        self.cache.set_seq_length(start + n)
        return logits

    def forward(self, new: torch.Tensor) -> torch.Tensor:
        """Feed (batch, n) int64 tokens (the last one, and a draft when verifying) after the cache;
        return their (batch, n, vocab_size) logits.

        Raises:
            ValueError: if a draft is longer than the verification chunk holds.
        """
        start, n = self.cache.get_seq_length(), new.shape[1]
        real = torch.ones_like(new, dtype=torch.bool)
        if n == 1:
            logits = self.steps["decode_one_token"](self.model, _dense(new), self.cache, self._feed(start, real, 1),
                                                    self.key_mask)
        else:
            if n > self.verify_len:
                raise ValueError(f"{n} tokens to verify, more than the verification chunk of {self.verify_len}")
            padded = _dense(torch.cat([new, new.new_zeros(new.shape[0], self.verify_len - n)], dim=1))
            logits = self.steps["verify"](self.model, padded, self.cache, self._feed(start, real, self.verify_len),
                                          self.key_mask)[:, :n]
        self.cache.set_seq_length(start + n)
        return logits
