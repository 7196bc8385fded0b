"""The model's layers: attention, positions, feed-forward, norms and the transformer block."""

from llm.layers.attention import MultiheadAttention, attention_heads, scaled_multihead_dot_product_attention
from llm.layers.blocks import MosaicGPTBlock
from llm.layers.ffn import GLU, MLP, build_ffn
from llm.layers.linear import Linear, linear
from llm.layers.norm import RMSNorm, build_norm
from llm.layers.positions import RotaryEmbedding, alibi_bias, alibi_slopes, position_ids_from_mask

__all__ = [
    "GLU", "Linear", "MLP", "MosaicGPTBlock", "MultiheadAttention", "RMSNorm", "RotaryEmbedding",
    "alibi_bias", "alibi_slopes", "attention_heads", "build_ffn", "build_norm", "linear",
    "position_ids_from_mask", "scaled_multihead_dot_product_attention",
]
