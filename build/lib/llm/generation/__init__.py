"""Decoding: the options (GenerationConfig), the generate loop (plain, reference and draft-model
speculative) and the samplers."""

from llm.generation.candidates import DraftModel, PromptLookup
from llm.generation.config import GENERATION_CONFIG_FILE, GenerationConfig
from llm.generation.generate import GenerateOutput, generate, stream
from llm.generation.sampling import Sampler, filter_logits

__all__ = ["GENERATION_CONFIG_FILE", "DraftModel", "GenerateOutput", "GenerationConfig", "PromptLookup", "Sampler",
           "filter_logits", "generate", "stream"]
