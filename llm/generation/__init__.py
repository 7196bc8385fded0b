"""Decoding: the generate loop (plain, reference and draft-model speculative) and the samplers."""

from llm.generation.candidates import DraftModel, PromptLookup
from llm.generation.generate import GenerateOutput, generate, stream
from llm.generation.sampling import Sampler, filter_logits, validate_sampling

__all__ = ["DraftModel", "GenerateOutput", "PromptLookup", "Sampler", "filter_logits", "generate", "stream",
           "validate_sampling"]
