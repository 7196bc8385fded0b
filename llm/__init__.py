"""llm: a MosaicGPT-style decoder-only transformer with a correct, fast KV cache."""

import gc as _gc

# Python's cyclic collector runs hundreds of passes while torch and this package are imported,
# over objects that all stay alive (0.12 s of a 1.37 s `import llm` on a Zen 4 core); it is paused
# for the imports and resumed as it was.
_collecting = _gc.isenabled()
_gc.disable()
try:
    from importlib.metadata import PackageNotFoundError, version as _version

    from llm.cache import Cache, DynamicCache, StaticCache
    from llm.config import MosaicGPTConfig
    from llm.data.tokenizer import load_tokenizer
    from llm.generation import GenerateOutput, GenerationConfig, generate, stream
    from llm.layers.attention import scaled_multihead_dot_product_attention
    from llm.model import CausalLMOutput, MosaicGPT
    from llm.quant import quantize

    # The formats layer registers its loaders (GGUF files, registered names) in llm.bundle.LOADERS,
    # which MosaicGPT.from_pretrained reads: the model cannot import the formats that build it.
    import llm.formats  # noqa: E402,F401  isort: skip
finally:
    if _collecting:
        _gc.enable()

try:
    __version__ = _version("mosaicgpt-llm")
except PackageNotFoundError:  # run from a checkout that was never installed
    __version__ = "0+unknown"

__all__ = [
    "Cache", "CausalLMOutput", "DynamicCache", "GenerateOutput", "GenerationConfig", "MosaicGPT", "MosaicGPTConfig",
    "StaticCache", "generate", "load_tokenizer", "quantize", "scaled_multihead_dot_product_attention", "stream",
]
