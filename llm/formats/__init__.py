"""Model formats that leave the package: transformers folders (:mod:`llm.formats.transformers`)
and GGUF files for llama.cpp (:mod:`llm.formats.gguf_writer`). The import side is
:mod:`llm.convert`."""
