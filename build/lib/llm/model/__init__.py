"""The model: :class:`MosaicGPT` (modules and the cache-aware forward, :mod:`llm.model.gpt`), the
checks and positions of its inputs (:mod:`llm.model.inputs`) and the blocks over a cache buffer
(:mod:`llm.model.buffer`). Generation, saving and loading live in :mod:`llm.generation` and
:mod:`llm.bundle`; the model's methods delegate to them."""

from llm.model.gpt import CausalLMOutput, MosaicGPT

__all__ = ["CausalLMOutput", "MosaicGPT"]
