"""Weight-only quantization as a module swap (gpt-fast's ``WeightOnlyInt8Linear`` / ``WeightOnlyInt4Linear``).

:func:`quantize` replaces a model's projections by :class:`Int8Linear` or :class:`Int4Linear`
and its output layer (and, when tied, the token embedding) by int8 per-row modules, so the model
file never branches on quantization. Everything else (residual stream, norms, softmax, the KV
cache) stays in the model's dtype.
"""

from llm.quant.modules import Int4Linear, Int8Embedding, Int8Linear, QuantizationReport
from llm.quant.quantize import METHODS, QUANTIZATION_FILE, quantize, quantize_like

__all__ = ["Int4Linear", "Int8Embedding", "Int8Linear", "METHODS", "QUANTIZATION_FILE", "QuantizationReport",
           "quantize", "quantize_like"]
