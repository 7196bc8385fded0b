"""GGUF files (llama.cpp's format) in and out: :mod:`~llm.formats.gguf.reader` loads Llama models
from them (their tokenizers: :mod:`llm.data.gguf_tokenizer`), :mod:`~llm.formats.gguf.writer`
exports ours."""

from llm.data.gguf_tokenizer import gguf_tokenizer
from llm.formats.gguf.reader import gguf_config, gguf_state_dict, int4_blocks, load_gguf
from llm.utils.gguf import read_gguf
from llm.formats.gguf.writer import GGUF_TYPES, gguf_tensors, permute, save_gguf

__all__ = ["GGUF_TYPES", "gguf_config", "gguf_state_dict", "gguf_tensors", "gguf_tokenizer", "int4_blocks",
           "load_gguf", "permute", "read_gguf", "save_gguf"]
