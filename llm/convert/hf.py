"""Load transformers' GPT-2 and MPT weights into MosaicGPT.

The mappings follow the parameter names of transformers' ``GPT2LMHeadModel`` (Conv1D weights are
stored (in, out), hence the transposes) and ``MptForCausalLM`` (whose names MosaicGPT shares).
"""

from __future__ import annotations

import torch

from llm.config import MosaicGPTConfig
from llm.model import MosaicGPT

_GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}


def gpt2_config(hf_config) -> MosaicGPTConfig:
    """The MosaicGPTConfig of a transformers ``GPT2Config``.

    Raises:
        ValueError: for GPT-2 options MosaicGPT does not implement (an unknown activation,
            attention scaled by layer index, untied embeddings).
    """
    if hf_config.activation_function not in _GPT2_ACTIVATIONS:
        raise ValueError(f"GPT-2 activation {hf_config.activation_function!r} is not supported; "
                         f"supported: {sorted(_GPT2_ACTIVATIONS)}")
    if hf_config.scale_attn_by_inverse_layer_idx or not hf_config.scale_attn_weights:
        raise ValueError("only GPT-2's default attention scaling (1/sqrt(head_dim)) is supported")
    inner = hf_config.n_inner or 4 * hf_config.n_embd
    return MosaicGPTConfig(
        vocab_size=hf_config.vocab_size, max_seq_len=hf_config.n_positions, d_model=hf_config.n_embd,
        n_heads=hf_config.n_head, n_layers=hf_config.n_layer, expansion_ratio=inner / hf_config.n_embd,
        ffn_act=_GPT2_ACTIVATIONS[hf_config.activation_function], learned_pos_emb=True,
        layer_norm_epsilon=hf_config.layer_norm_epsilon, tie_word_embeddings=True,
    )


def from_hf_gpt2(hf_model, attn_impl: str = "sdpa") -> MosaicGPT:
    """A MosaicGPT with the weights of a transformers ``GPT2LMHeadModel``, in eval mode, float32."""
    config = gpt2_config(hf_model.config)
    config.attn_impl = attn_impl
    sd = {k.removeprefix("transformer."): v for k, v in hf_model.state_dict().items()}
    state = {"wte.weight": sd["wte.weight"], "wpe.weight": sd["wpe.weight"],
             "norm_f.weight": sd["ln_f.weight"], "norm_f.bias": sd["ln_f.bias"]}
    for i in range(config.n_layers):
        h, b = f"h.{i}.", f"blocks.{i}."
        for theirs, ours in (("ln_1", "norm_1"), ("ln_2", "norm_2")):
            state[f"{b}{ours}.weight"] = sd[f"{h}{theirs}.weight"]
            state[f"{b}{ours}.bias"] = sd[f"{h}{theirs}.bias"]
        for theirs, ours in (("attn.c_attn", "attn.Wqkv"), ("attn.c_proj", "attn.out_proj"),
                             ("mlp.c_fc", "ffn.up_proj"), ("mlp.c_proj", "ffn.down_proj")):
            state[f"{b}{ours}.weight"] = sd[f"{h}{theirs}.weight"].t()
            state[f"{b}{ours}.bias"] = sd[f"{h}{theirs}.bias"]
    return _build(config, state)


def mpt_config(hf_config) -> MosaicGPTConfig:
    """The MosaicGPTConfig of a transformers ``MptConfig`` (ALiBi, no biases, tied embeddings).

    Raises:
        ValueError: for MPT options transformers' MPT does not implement either, or that we do not
            (clip_qkv, qk_ln, a custom softmax_scale).
    """
    attn = hf_config.attn_config
    if attn.clip_qkv or attn.qk_ln or attn.softmax_scale is not None:
        raise ValueError("MPT's clip_qkv, qk_ln and softmax_scale options are not supported")
    # transformers' MptModel always applies ALiBi and a 4x MLP, whatever the config says.
    return MosaicGPTConfig(
        vocab_size=hf_config.vocab_size, max_seq_len=hf_config.max_seq_len, d_model=hf_config.d_model,
        n_heads=hf_config.n_heads, n_layers=hf_config.n_layers, expansion_ratio=4, ffn_act="gelu",
        learned_pos_emb=False, alibi=True, alibi_bias_max=attn.alibi_bias_max, no_bias=True,
        layer_norm_epsilon=hf_config.layer_norm_epsilon, tie_word_embeddings=True,
    )


def from_hf_mpt(hf_model, attn_impl: str = "sdpa") -> MosaicGPT:
    """A MosaicGPT with the weights of a transformers ``MptForCausalLM``, in eval mode, float32."""
    config = mpt_config(hf_model.config)
    config.attn_impl = attn_impl
    state = {k.removeprefix("transformer."): v for k, v in hf_model.state_dict().items()
             if k != "lm_head.weight"}  # tied to wte
    return _build(config, state)


def from_transformers(hf_model, attn_impl: str = "sdpa") -> MosaicGPT:
    """Dispatch on ``hf_model.config.model_type`` (``gpt2`` or ``mpt``).

    Raises:
        ValueError: for another architecture, naming it and the supported ones.
    """
    converters = {"gpt2": from_hf_gpt2, "mpt": from_hf_mpt}
    model_type = hf_model.config.model_type
    if model_type not in converters:
        raise ValueError(f"cannot convert a {model_type!r} model; supported: {sorted(converters)}")
    return converters[model_type](hf_model, attn_impl=attn_impl)


def _build(config: MosaicGPTConfig, state: dict[str, torch.Tensor]) -> MosaicGPT:
    with torch.device("meta"):
        model = MosaicGPT(config)
    model.load_state_dict({k: v.detach().float().clone() for k, v in state.items()}, strict=True, assign=True)
    return model.eval()
