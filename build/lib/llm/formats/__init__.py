"""Model formats in and out of the package: transformers (:mod:`llm.formats.transformers`: GPT-2 and
MPT weights in; Llama, GPT-2 and MPT folders out), GGUF for llama.cpp (:mod:`llm.formats.gguf`:
reader and writer). Registered pretrained names live in :mod:`llm.utils.pretrained`, tokenizers in
:mod:`llm.data.tokenizer`; both are re-exported here."""

from llm.formats.gguf import gguf_config, gguf_tokenizer, load_gguf, read_gguf, save_gguf
from llm.utils.pretrained import PRETRAINED
from llm.data.tokenizer import load_tokenizer
from llm.formats.transformers import (from_hf_gpt2, from_hf_mpt, from_transformers, gpt2_config, mpt_config,
                                      save_transformers)
from llm.bundle import LOADERS

LOADERS["gguf"] = load_gguf

__all__ = ["PRETRAINED", "from_hf_gpt2", "from_hf_mpt", "from_transformers", "gguf_config", "gguf_tokenizer",
           "gpt2_config", "load_gguf", "load_tokenizer", "mpt_config", "read_gguf", "save_gguf", "save_transformers"]
