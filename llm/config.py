"""The model's configuration: every option of MosaicGPT, validated up front.

Option names follow llm-foundry's MPT (``d_model``, ``n_heads``, ``expansion_ratio``, ``alibi``,
``kv_n_heads``, ``rope_theta``, ...), so configs read the same as theirs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping


from llm.utils.config import from_dict

ATTN_IMPLS = ("torch", "sdpa")
FFN_TYPES = ("mlp", "glu")
FFN_ACTS = ("gelu", "gelu_tanh", "relu", "relu2", "silu")
NORM_TYPES = ("layernorm", "rmsnorm")
FLOAT_KEYS = ("expansion_ratio", "emb_pdrop", "resid_pdrop", "attn_pdrop", "rope_theta", "init_std",
              "layer_norm_epsilon")
BOOL_KEYS = ("learned_pos_emb", "alibi", "rope", "no_bias", "tie_word_embeddings", "qk_norm", "zero_init_residual")


@dataclass
class MosaicGPTConfig:
    """Hyper-parameters of a MosaicGPT decoder-only transformer.

    Positions are exactly one of: learned embeddings (``learned_pos_emb``, as GPT-2), ALiBi
    (``alibi``, Press et al. 2022, as MPT) or rotary embeddings (``rope``, Su et al. 2021, as
    Llama). ``kv_n_heads`` < ``n_heads`` gives grouped-query attention (Ainslie et al. 2023).

    Parts of the modded-nanogpt speedrun recipe: ``qk_norm`` (each query and key head
    RMS-normalized, without a weight, before rotary positions; Henry et al. 2020, Dehghani et al.
    2023), ``ffn_act: relu2`` (``relu(x)^2``, So et al. 2021), ``logit_softcap`` (logits
    ``c * tanh(logits / c)``, as Gemma 2), ``zero_init_residual`` (the projections into the
    residual stream, ``out_proj`` and ``down_proj``, start at zero, so each block starts as the
    identity) and an untied output layer (``tie_word_embeddings: false``).

    Raises:
        ValueError: on construction, for any impossible value, naming the key and what is allowed.
    """

    vocab_size: int = 50257
    max_seq_len: int = 1024
    d_model: int = 768
    n_heads: int = 12
    n_layers: int = 12
    expansion_ratio: float = 4.0
    emb_pdrop: float = 0.0
    resid_pdrop: float = 0.0
    attn_pdrop: float = 0.0
    learned_pos_emb: bool = True
    alibi: bool = False
    alibi_bias_max: int = 8
    rope: bool = False
    rope_theta: float = 10000.0
    kv_n_heads: int | None = None
    attn_impl: str = "sdpa"
    ffn_type: str = "mlp"
    ffn_act: str = "gelu"
    ffn_hidden_size: int | None = None
    norm_type: str = "layernorm"
    no_bias: bool = False
    init_std: float = 0.02
    tie_word_embeddings: bool = True
    layer_norm_epsilon: float = 1e-5
    qk_norm: bool = False
    logit_softcap: float | None = None
    zero_init_residual: bool = False

    def __post_init__(self) -> None:
        if self.kv_n_heads is None:
            self.kv_n_heads = self.n_heads
        self._validate()

    def _validate(self) -> None:
        for key in ("vocab_size", "max_seq_len", "d_model", "n_heads", "n_layers", "kv_n_heads"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be a positive integer, got {value!r}")
        for key in FLOAT_KEYS:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{key} must be a finite number, got {value!r}")
        for key in BOOL_KEYS:
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"{key} must be true or false, got {getattr(self, key)!r}")
        for key in ("alibi_bias_max", "ffn_hidden_size"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{key} must be an integer, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )
        if self.n_heads % self.kv_n_heads:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be divisible by kv_n_heads ({self.kv_n_heads})"
            )
        for key in ("emb_pdrop", "resid_pdrop", "attn_pdrop"):
            value = getattr(self, key)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{key} must be in [0, 1), got {value!r}")
        if sum(bool(x) for x in (self.learned_pos_emb, self.alibi, self.rope)) > 1:
            raise ValueError(
                "learned_pos_emb, alibi and rope are mutually exclusive: set at most one to true "
                f"(got learned_pos_emb={self.learned_pos_emb}, alibi={self.alibi}, rope={self.rope})"
            )
        if self.rope and self.head_dim % 2:
            raise ValueError(f"rope needs an even head size, got d_model/n_heads={self.head_dim}")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta!r}")
        if self.alibi_bias_max <= 0:
            raise ValueError(f"alibi_bias_max must be > 0, got {self.alibi_bias_max!r}")
        for key, allowed in (
            ("attn_impl", ATTN_IMPLS),
            ("ffn_type", FFN_TYPES),
            ("ffn_act", FFN_ACTS),
            ("norm_type", NORM_TYPES),
        ):
            if getattr(self, key) not in allowed:
                raise ValueError(f"{key} must be one of {allowed}, got {getattr(self, key)!r}")
        if self.expansion_ratio <= 0:
            raise ValueError(f"expansion_ratio must be > 0, got {self.expansion_ratio!r}")
        if self.ffn_hidden_size is not None and self.ffn_hidden_size < 1:
            raise ValueError(f"ffn_hidden_size must be a positive integer, got {self.ffn_hidden_size!r}")
        if self.hidden_size < 1:
            raise ValueError(
                f"expansion_ratio {self.expansion_ratio!r} * d_model {self.d_model} gives a feed-forward width "
                f"of {self.hidden_size} (< 1): raise expansion_ratio to at least {1 / self.d_model:.3g} or set "
                "ffn_hidden_size"
            )
        if self.logit_softcap is not None and (isinstance(self.logit_softcap, bool)
                                               or not isinstance(self.logit_softcap, (int, float))
                                               or not math.isfinite(self.logit_softcap) or self.logit_softcap <= 0):
            raise ValueError(f"logit_softcap must be a number > 0 (as 15 or 30) or null, got {self.logit_softcap!r}")
        for key in ("init_std", "layer_norm_epsilon"):
            if getattr(self, key) <= 0:
                raise ValueError(f"{key} must be > 0, got {getattr(self, key)!r}")

    @property
    def head_dim(self) -> int:
        """Size of one attention head: d_model // n_heads."""
        return self.d_model // self.n_heads

    @property
    def hidden_size(self) -> int:
        """Width of the feed-forward layer: ffn_hidden_size, else expansion_ratio * d_model."""
        return self.ffn_hidden_size or int(self.expansion_ratio * self.d_model)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "MosaicGPTConfig":
        """Build a config from a mapping (a dict or an omegaconf node), read as an OmegaConf
        structured config (:func:`llm.utils.config.from_dict`).

        Raises:
            llm.utils.config.ConfigError: (a ValueError) for an unknown key (naming it and listing
                the allowed keys), a value of the wrong type or a bad value, naming the key.
        """
        return from_dict(cls, values)

    def to_dict(self) -> dict[str, Any]:
        """All options as a plain dict."""
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> None:
        """Write the config as YAML."""
        from omegaconf import OmegaConf  # imported when used: see llm.utils.config._omegaconf

        OmegaConf.save(OmegaConf.create(self.to_dict()), str(path))

    @classmethod
    def load(cls, path: str | Path) -> "MosaicGPTConfig":
        """Read a config written by :meth:`save` (or any YAML with these keys)."""
        from omegaconf import OmegaConf  # imported when used: see llm.utils.config._omegaconf

        return cls.from_dict(OmegaConf.load(str(path)))
