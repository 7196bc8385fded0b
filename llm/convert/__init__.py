"""Converters from other implementations' weights into MosaicGPT."""

from llm.convert.hf import from_hf_gpt2, from_hf_mpt, from_transformers, gpt2_config, mpt_config

__all__ = ["from_hf_gpt2", "from_hf_mpt", "from_transformers", "gpt2_config", "mpt_config"]
