"""transformers' models in and out: GPT-2 and MPT weights into MosaicGPT, and export to a
transformers folder (``config.json``, ``model.safetensors``, tokenizer, generation config).

Imports follow the parameter names of transformers' ``GPT2LMHeadModel`` (Conv1D weights are
stored (in, out), hence the transposes) and ``MptForCausalLM`` (whose names MosaicGPT shares).
An export's architecture is the one that represents the model exactly (the inverse of the
imports, and of llm-foundry's ``convert_composer_to_hf.py``):

- Llama (``LlamaForCausalLM``) for rotary positions + GLU/SiLU + RMSNorm (any key heads; biases
  as ``attention_bias`` / ``mlp_bias``); our rotary is transformers' ``rotate_half`` convention,
  so Q and K rows are written as they are;
- GPT-2 (``GPT2LMHeadModel``) for learned positions + LayerNorm + a GELU (erf or tanh) or ReLU
  MLP with one key head per query head (Conv1D weights stored (in, out), hence transposed;
  absent biases written as zeros);
- MPT (``MptForCausalLM``) for ALiBi + LayerNorm + GELU MLP of 4 x d_model without biases,
  tied embeddings and one key head per query head (what transformers' MPT implements).

Anything else is refused, naming the option that does not fit: never exported approximately.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from llm.config import MosaicGPTConfig
from llm.formats.files import replace_directory
from llm.model import MosaicGPT

_GPT2_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}


def _ffn_hidden(config: MosaicGPTConfig) -> int:
    return config.ffn_hidden_size or int(config.expansion_ratio * config.d_model)


def architecture(config: MosaicGPTConfig) -> str:
    """``"llama"``, ``"gpt2"`` or ``"mpt"``: the transformers architecture that is this model exactly.

    Raises:
        ValueError: naming the options no transformers architecture expresses together.
    """
    c = config
    recipe = [k for k, on in (("qk_norm", c.qk_norm), ("logit_softcap", c.logit_softcap is not None),
                              ("ffn_act relu2", c.ffn_act == "relu2")) if on]
    if recipe:
        raise ValueError(f"{' and '.join(recipe)}: none of the architectures a model exports as (Llama, GPT-2, "
                         f"MPT) has {'them' if len(recipe) > 1 else 'it'}; a model trained with "
                         f"{'them' if len(recipe) > 1 else 'it'} runs here only")
    if c.rope:
        wrong = [f"{k}={getattr(c, k)!r} (Llama needs {v!r})" for k, v in
                 (("ffn_type", "glu"), ("ffn_act", "silu"), ("norm_type", "rmsnorm")) if getattr(c, k) != v]
        if not wrong:
            return "llama"
        raise ValueError("a rotary model exports as Llama, which has " + ", ".join(wrong) + " against it")
    if c.learned_pos_emb:
        wrong = [f"{k}={getattr(c, k)!r}" for k, ok in (("ffn_type", c.ffn_type == "mlp"),
                                                          ("norm_type", c.norm_type == "layernorm"),
                                                          ("ffn_act", c.ffn_act in _GPT2_ACTIVATIONS),
                                                          ("kv_n_heads", c.kv_n_heads == c.n_heads)) if not ok]
        if not wrong:
            return "gpt2"
        raise ValueError("a model with learned positions exports as GPT-2 (ffn_type mlp, norm_type layernorm, "
                         f"ffn_act in {sorted(_GPT2_ACTIVATIONS)}, kv_n_heads = n_heads), which "
                         + ", ".join(wrong) + " does not fit")
    wrong = [f"{k}={getattr(c, k)!r}" for k, ok in (
        ("ffn_type", c.ffn_type == "mlp"), ("ffn_act", c.ffn_act == "gelu"), ("norm_type", c.norm_type == "layernorm"),
        ("no_bias", c.no_bias), ("tie_word_embeddings", c.tie_word_embeddings),
        ("kv_n_heads", c.kv_n_heads == c.n_heads), ("ffn_hidden_size", _ffn_hidden(c) == 4 * c.d_model)) if not ok]
    if not wrong:
        return "mpt"
    raise ValueError("an ALiBi model exports as MPT (ffn_type mlp, ffn_act gelu, norm_type layernorm, no_bias, "
                     "tied embeddings, kv_n_heads = n_heads, a 4 x d_model MLP), which " + ", ".join(wrong)
                     + " does not fit")


def hf_config(config: MosaicGPTConfig):
    """The transformers config (``LlamaConfig``, ``GPT2Config`` or ``MptConfig``) of ``config``.

    Raises:
        ValueError: as :func:`architecture`.
    """
    from transformers import GPT2Config, LlamaConfig, MptConfig

    c, arch = config, architecture(config)
    if arch == "llama":
        return LlamaConfig(
            vocab_size=c.vocab_size, hidden_size=c.d_model, intermediate_size=_ffn_hidden(c),
            num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads, num_key_value_heads=c.kv_n_heads,
            head_dim=c.head_dim, max_position_embeddings=c.max_seq_len, rms_norm_eps=c.layer_norm_epsilon,
            rope_theta=c.rope_theta, tie_word_embeddings=c.tie_word_embeddings, attention_bias=not c.no_bias,
            mlp_bias=not c.no_bias, hidden_act="silu", architectures=["LlamaForCausalLM"],
            bos_token_id=None, eos_token_id=None, torch_dtype="float32")
    if arch == "gpt2":
        return GPT2Config(
            vocab_size=c.vocab_size, n_positions=c.max_seq_len, n_embd=c.d_model, n_layer=c.n_layers,
            n_head=c.n_heads, n_inner=_ffn_hidden(c), activation_function=_GPT2_ACTIVATIONS[c.ffn_act],
            layer_norm_epsilon=c.layer_norm_epsilon, tie_word_embeddings=c.tie_word_embeddings,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, architectures=["GPT2LMHeadModel"],
            bos_token_id=None, eos_token_id=None, torch_dtype="float32")
    return MptConfig(
        d_model=c.d_model, n_heads=c.n_heads, n_layers=c.n_layers, expansion_ratio=4, max_seq_len=c.max_seq_len,
        vocab_size=c.vocab_size, layer_norm_epsilon=c.layer_norm_epsilon, no_bias=True,
        attn_config={"alibi": True, "alibi_bias_max": c.alibi_bias_max}, architectures=["MptForCausalLM"],
        torch_dtype="float32")


def hf_state_dict(model) -> dict[str, torch.Tensor]:
    """``model``'s weights under the transformers architecture's names and layouts (copies).

    Raises:
        ValueError: for a quantized model (load it without quantization to export), or as
            :func:`architecture`.
    """
    if getattr(model, "quantization", None) is not None:
        raise ValueError("a quantized model cannot be exported to transformers: load it unquantized (a GGUF file "
                         "with quantization=\"none\"; a quantized bundle holds no float weights)")
    c, arch = model.config, architecture(model.config)
    sd = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}
    out: dict[str, torch.Tensor] = {}
    q_size, kv_size = c.n_heads * c.head_dim, c.kv_n_heads * c.head_dim

    def bias_or_zeros(name: str, size: int) -> torch.Tensor:
        return sd[name].clone() if name in sd else torch.zeros(size)

    if arch == "llama":
        out["model.embed_tokens.weight"] = sd["wte.weight"].clone()
        out["model.norm.weight"] = sd["norm_f.weight"].clone()
        if not c.tie_word_embeddings:
            out["lm_head.weight"] = sd["lm_head.weight"].clone()
        for i in range(c.n_layers):
            b, h = f"blocks.{i}.", f"model.layers.{i}."
            out[h + "input_layernorm.weight"] = sd[b + "norm_1.weight"].clone()
            out[h + "post_attention_layernorm.weight"] = sd[b + "norm_2.weight"].clone()
            for suffix in ("weight", "bias"):
                if b + f"attn.Wqkv.{suffix}" not in sd:
                    continue
                q, k, v = sd[b + f"attn.Wqkv.{suffix}"].split([q_size, kv_size, kv_size], dim=0)
                for name, t in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                    out[h + f"self_attn.{name}.{suffix}"] = t.clone()
                out[h + f"self_attn.o_proj.{suffix}"] = sd[b + f"attn.out_proj.{suffix}"].clone()
                for name in ("gate_proj", "up_proj", "down_proj"):
                    out[h + f"mlp.{name}.{suffix}"] = sd[b + f"ffn.{name}.{suffix}"].clone()
        return out
    if arch == "gpt2":
        out["transformer.wte.weight"] = sd["wte.weight"].clone()
        out["transformer.wpe.weight"] = sd["wpe.weight"].clone()
        out["transformer.ln_f.weight"] = sd["norm_f.weight"].clone()
        out["transformer.ln_f.bias"] = bias_or_zeros("norm_f.bias", c.d_model)
        if not c.tie_word_embeddings:
            out["lm_head.weight"] = sd["lm_head.weight"].clone()
        for i in range(c.n_layers):
            b, h = f"blocks.{i}.", f"transformer.h.{i}."
            for ours, theirs in (("norm_1", "ln_1"), ("norm_2", "ln_2")):
                out[h + f"{theirs}.weight"] = sd[b + f"{ours}.weight"].clone()
                out[h + f"{theirs}.bias"] = bias_or_zeros(b + f"{ours}.bias", c.d_model)
            for ours, theirs in (("attn.Wqkv", "attn.c_attn"), ("attn.out_proj", "attn.c_proj"),
                                 ("ffn.up_proj", "mlp.c_fc"), ("ffn.down_proj", "mlp.c_proj")):
                weight = sd[b + f"{ours}.weight"]
                out[h + f"{theirs}.weight"] = weight.t().contiguous()  # Conv1D: (in, out)
                out[h + f"{theirs}.bias"] = bias_or_zeros(b + f"{ours}.bias", weight.shape[0])
        return out
    return {f"transformer.{k}": v.clone() for k, v in sd.items() if k != "lm_head.weight"}


def _transformers_generation_config(generation_config, tokenizer):
    from transformers import GenerationConfig as HFGenerationConfig

    options = {}
    if generation_config is not None:
        g = generation_config
        options = dict(do_sample=g.do_sample, temperature=g.temperature, top_k=g.top_k, top_p=g.top_p,
                       min_p=g.min_p, repetition_penalty=g.repetition_penalty, max_new_tokens=g.max_new_tokens,
                       eos_token_id=list(g.eos_token_id) if isinstance(g.eos_token_id, tuple) else g.eos_token_id,
                       pad_token_id=g.pad_token_id)
    if tokenizer is not None:
        if options.get("eos_token_id") is None:
            options["eos_token_id"] = tokenizer.eos_token_id
        if options.get("pad_token_id") is None:
            options["pad_token_id"] = tokenizer.pad_token_id
        if tokenizer.bos_token_id is not None:
            options["bos_token_id"] = tokenizer.bos_token_id
    return HFGenerationConfig(**{k: v for k, v in options.items() if v is not None})


def save_transformers(model, directory: str | os.PathLike, tokenizer=None, generation_config=None, *,
                      overwrite: bool = False) -> str:
    """Write ``model`` as a transformers folder that ``AutoModelForCausalLM.from_pretrained`` loads
    (no ``trust_remote_code``); returns the architecture ("llama", "gpt2" or "mpt").

    Args:
        model: a float :class:`~llm.model.MosaicGPT`.
        directory: the folder to write (atomically: built beside it, then renamed).
        tokenizer: saved with it (chat template included), if given.
        generation_config: an :class:`~llm.generation.GenerationConfig` written as transformers'
            ``generation_config.json`` (default: the model's).

    Raises:
        ValueError: for a configuration no transformers architecture expresses exactly, or a
            quantized model.
        FileExistsError: if ``directory`` exists and not ``overwrite``.
    """
    from safetensors.torch import save_file

    config = hf_config(model.config)
    state = hf_state_dict(model)
    generation = _transformers_generation_config(
        generation_config if generation_config is not None else getattr(model, "generation_config", None), tokenizer)
    if tokenizer is not None:
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if getattr(tokenizer, key) is not None:
                setattr(config, key, getattr(tokenizer, key))

    def write(tmp: Path) -> None:
        config.save_pretrained(tmp)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        generation.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))

    replace_directory(Path(directory), write, overwrite)
    return architecture(model.config)


# -- import ------------------------------------------------------------------------------------
_GPT2_IMPORTED_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}


def gpt2_config(hf_config) -> MosaicGPTConfig:
    """The MosaicGPTConfig of a transformers ``GPT2Config``.

    Raises:
        ValueError: for GPT-2 options MosaicGPT does not implement (an unknown activation,
            attention scaled by layer index, untied embeddings).
    """
    if hf_config.activation_function not in _GPT2_IMPORTED_ACTIVATIONS:
        raise ValueError(f"GPT-2 activation {hf_config.activation_function!r} is not supported; "
                         f"supported: {sorted(_GPT2_IMPORTED_ACTIVATIONS)}")
    if hf_config.scale_attn_by_inverse_layer_idx or not hf_config.scale_attn_weights:
        raise ValueError("only GPT-2's default attention scaling (1/sqrt(head_dim)) is supported")
    inner = hf_config.n_inner or 4 * hf_config.n_embd
    return MosaicGPTConfig(
        vocab_size=hf_config.vocab_size, max_seq_len=hf_config.n_positions, d_model=hf_config.n_embd,
        n_heads=hf_config.n_head, n_layers=hf_config.n_layer, expansion_ratio=inner / hf_config.n_embd,
        ffn_act=_GPT2_IMPORTED_ACTIVATIONS[hf_config.activation_function], learned_pos_emb=True,
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
    model = MosaicGPT.empty(config)
    model.load_state_dict({k: v.detach().float().clone() for k, v in state.items()}, strict=True, assign=True)
    return model.eval()
