"""Converters from other implementations' weights into MosaicGPT."""

from llm.convert.gguf import gguf_config, gguf_tokenizer, load_gguf, read_gguf
from llm.convert.hf import from_hf_gpt2, from_hf_mpt, from_transformers, gpt2_config, mpt_config
from llm.convert.registry import PRETRAINED, load_tokenizer

__all__ = ["PRETRAINED", "from_hf_gpt2", "from_hf_mpt", "from_transformers", "gguf_config", "gguf_tokenizer",
           "gpt2_config", "load_gguf", "load_tokenizer", "mpt_config", "read_gguf"]
