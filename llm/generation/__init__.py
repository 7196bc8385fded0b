"""Decoding: the generate loop and the samplers."""

from llm.generation.generate import GenerateOutput, generate
from llm.generation.sampling import filter_logits, next_tokens, validate_sampling

__all__ = ["GenerateOutput", "filter_logits", "generate", "next_tokens", "validate_sampling"]
