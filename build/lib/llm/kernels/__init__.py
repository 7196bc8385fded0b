"""Our own compute kernels: CPU int4/int8 matmuls, attention and fused Llama blocks (:mod:`llm.kernels.cpu_quant`), and
the checks of torch's quantized kernels (:mod:`llm.kernels.quant`)."""
