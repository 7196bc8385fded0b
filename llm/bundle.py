"""Saving and loading models: a bundle directory (``config.yaml``, ``model.safetensors``, optional
``quantization.json``, ``generation_config.json`` and tokenizer), or through :data:`LOADERS`
another format (a GGUF file, a registered name).

The functions take the model (or its class) as an argument, so this module sits below
:mod:`llm.model`, whose ``save_pretrained`` / ``from_pretrained`` call them (as transformers'
``PreTrainedModel`` methods call ``modeling_utils``).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from llm.config import FLOAT_KEYS, MosaicGPTConfig
from llm.data.sources import DataError
from llm.generation.config import GENERATION_CONFIG_FILE, GenerationConfig, load_generation_config
from llm.io import atomic_write, shape_mismatches
from llm.quant import METHODS, QUANTIZATION_FILE, quantize, quantize_like
from llm.quant.quantize import EMBEDDING, HEAD, check_backend, projections
from llm.utils.pretrained import resolve, unknown_model
from llm.utils.tokens import TOKENIZER_DIGEST_KEY, tokenizer_digest, tokenizer_misfit

CONFIG_FILE = "config.yaml"
WEIGHTS_FILE = "model.safetensors"
#: Loaders of the files that are not bundles, by the kind :func:`llm.utils.pretrained.resolve` gives
#: (``"gguf"``): :mod:`llm.formats` builds these models, so it registers its loaders here rather
#: than this module importing it (``import llm`` does that). Each takes ``(path, *, dtype,
#: device, quantization, group_size, backend)``.
LOADERS: dict[str, Callable[..., Any]] = {}
#: Key of ``model.safetensors``' metadata holding :func:`weights_digest` of the tensors written.
WEIGHTS_DIGEST_KEY = "llm.weights_sha256"


def weights_digest(state: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 (hex) of a state dict: every tensor's name, dtype, shape and bytes, in key order.

    Costs a pass over the weights, on the CPU: about a second for SmolLM2-135M's 540 MB of float32 here.
    """
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach()
        digest.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}\n".encode())
        digest.update(tensor.cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def weights_to_save(model) -> dict[str, torch.Tensor]:
    """``model``'s state dict as :func:`save_pretrained` writes it: a quantized output layer tied to
    the embedding shares its int8 storage, so it is written once, as ``wte.*``."""
    state = model.state_dict()
    if model.quantization is not None and model.config.tie_word_embeddings:
        state = {k: v for k, v in state.items() if not k.startswith("lm_head.")}
    return state


def _weights_key(state: Mapping[str, torch.Tensor]) -> tuple:
    """What changes when a weight is written in place, replaced or moved."""
    # inference tensors keep no version counter; they can only be written in inference mode
    return tuple((name, -1 if t.is_inference() else t._version, t.data_ptr(), t.dtype, t.device)
                 for name, t in state.items())


def remember_digest(model, digest: str) -> None:
    """Take ``digest`` as the :func:`weights_digest` of ``model``'s weights as they are now (see
    :func:`model_identity`)."""
    model._digest = (_weights_key(weights_to_save(model)), digest)


def model_identity(model) -> str:
    """SHA-256 (hex) of a model's config and weights: which model this is, e.g. for a saved KV
    cache to be reused by the model that made it only (:meth:`llm.cache.Cache.load`).

    The config counts without ``attn_impl`` (how attention is computed, not what); the weights
    with their dtype (:func:`weights_digest`), so a cast model is another model. The weights are
    hashed at the first call and the result kept in ``model._digest`` while every tensor of the
    state dict keeps its autograd version counter and storage, and the model stays in eval mode:
    an optimizer step, ``load_state_dict`` or a move gives a new identity. Entering training mode
    forgets it (a fused optimizer's step does not count versions); writes through
    ``param.data`` in eval mode are not seen. :func:`from_pretrained` knows a bundle's digest
    without hashing (:func:`save_pretrained` stores it); a GGUF model is hashed like a model
    built in memory, so it shares its identity with its saved bundle.
    """
    state = weights_to_save(model)
    key = _weights_key(state)
    if model._digest is not None and model._digest[0] == key:
        digest = model._digest[1]
    else:
        digest = weights_digest(state)
        model._digest = None if model.training else (key, digest)
    config = {k: float(v) if k in FLOAT_KEYS else v for k, v in model.config.to_dict().items() if k != "attn_impl"}
    return hashlib.sha256(f"{json.dumps(config, sort_keys=True)}\n{digest}".encode()).hexdigest()


def save_pretrained(model, directory: str | os.PathLike, tokenizer=None,
                    generation_config: GenerationConfig | None = None) -> None:
    """Write ``model``'s ``config.yaml`` and ``model.safetensors`` (and the tokenizer, if given) to ``directory``.

    A quantized model (:func:`llm.quant.quantize`) writes its quantized tensors (int4 codes
    unpacked, one uint8 per weight: the packed layout depends on the CPU) and
    ``quantization.json``, which :func:`from_pretrained` reads to rebuild the same modules.

    ``generation_config`` (default: ``model.generation_config``) goes to
    ``generation_config.json`` unless it is all defaults, in which case an older such file is
    removed, so that the folder's generation defaults are always this model's. Each file is
    written to a temporary name and renamed, so a crash never leaves a half written file under
    the real name. The weights' metadata holds their :func:`weights_digest` (hashed from the
    very tensors written), from which :func:`from_pretrained` knows the model's ``identity()``.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in weights_to_save(model).items()}
    metadata = {"format": "pt", WEIGHTS_DIGEST_KEY: weights_digest(state)}
    if tokenizer is not None:  # so that a tokenizer put in the folder later is known not to be it
        metadata[TOKENIZER_DIGEST_KEY] = tokenizer_digest(tokenizer)
    atomic_write(directory / CONFIG_FILE, model.config.save)
    atomic_write(directory / WEIGHTS_FILE, lambda path: save_file(state, path, metadata=metadata))
    if model.quantization is not None:
        text = json.dumps(model.quantization.to_dict(), indent=2) + "\n"
        atomic_write(directory / QUANTIZATION_FILE, lambda path: Path(path).write_text(text))
    else:
        (directory / QUANTIZATION_FILE).unlink(missing_ok=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))
    generation_config = generation_config if generation_config is not None else model.generation_config
    if generation_config != GenerationConfig():
        generation_config.to_json_file(directory / GENERATION_CONFIG_FILE)
    else:
        (directory / GENERATION_CONFIG_FILE).unlink(missing_ok=True)


def from_pretrained(
    cls: type,
    name_or_path: str | os.PathLike,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    quantization: str | None = None,
    group_size: int = 32,
    backend: str = "auto",
) -> Any:
    """Load a pretrained model of class ``cls`` (:class:`~llm.model.MosaicGPT`), in eval mode: a directory written by :func:`save_pretrained`,
    a Llama-architecture ``.gguf`` file (llama.cpp; dequantized, float32 unless ``dtype``), or
    a registered name (``"smollm2-135m-instruct"``, see :mod:`llm.utils.pretrained`).
    ``generation_config`` is the directory's ``generation_config.json`` if it has one, the
    registered model's recommended settings (``GENERATION_DEFAULTS``), else the defaults.

    Args:
        quantization: None: the weights as stored (a quantized bundle loads quantized, a
            quantized GGUF file on its own blocks as with ``"gguf"``, anything else in floating
            point); ``"none"``: a GGUF file dequantized to floating point, a bundle as stored;
            ``"int8"`` / ``"int4"``: quantize while loading (:func:`llm.quant.quantize`), one
            tensor at a time, so the float model is never held whole; ``"gguf"``: keep a GGUF
            file's own quantization (:func:`llm.formats.gguf.load_gguf`: Q4_0 / Q4_1 blocks
            become int4 groups of 32 without requantizing).
        group_size: int4 group size for ``quantization="int4"``.
        backend: whose kernels quantized layers take: ``"auto"`` (ours where they run, see
            :func:`llm.quant.quantize`), ``"llm"`` or ``"torch"``.

    Raises:
        FileNotFoundError: if the directory, its config or its weights are missing, or the
            GGUF file is (for a registered name: run ``llm fetch NAME``).
        ValueError: if the weights are unreadable (e.g. truncated) or do not fit the config,
            naming the file and the tensors that did not fit; if a weight holds NaN or
            infinity (:func:`check_finite_weights`); if ``generation_config.json``
            is not a valid generation config (naming it); an unknown ``quantization``, or one
            that contradicts a quantized bundle's, or ``"gguf"`` for a bundle; a bad
            ``backend`` (or ``"llm"`` where our kernels cannot run); for a GGUF
            file, also an unsupported architecture or quantization type (see
            :func:`llm.formats.load_gguf`).
    """
    if quantization is not None and quantization not in ("none", *METHODS, "gguf"):
        raise ValueError(f"quantization must be one of {('none', *METHODS, 'gguf')}, got {quantization!r}")
    check_backend(backend, device or "cpu")
    kind, directory = locate(name_or_path)
    if kind in LOADERS:
        model = LOADERS[kind](directory, dtype=dtype, device=device, quantization=quantization,
                              group_size=group_size, backend=backend)
        # a registered name's recommended sampling over the file's own end and pad ids
        defaults, own = load_generation_config(name_or_path), model.generation_config
        if defaults is not None:
            ids = {key: getattr(own, key) for key in ("eos_token_id", "pad_token_id")
                   if getattr(defaults, key) is None and getattr(own, key) is not None}
            model.generation_config = defaults.update(**ids) if ids else defaults
        check_finite_weights(model, directory)
        return model
    config = MosaicGPTConfig.load(directory / CONFIG_FILE)
    saved = _read_quantization(directory)
    quantization = None if quantization == "none" else quantization
    if quantization == "gguf":
        raise ValueError(f'quantization="gguf" keeps a GGUF file\'s own quantization; {directory} is a bundle: '
                         f'load a .gguf file, or quantize the bundle with "int8" or "int4"')
    if saved is not None and quantization not in (None, saved.get("method")):
        raise ValueError(f"{directory} holds {saved.get('method')} weights; load it with quantization=\"none\" "
                         f"(requantizing {saved.get('method')} weights as {quantization} is not supported)")
    weights_path = directory / WEIGHTS_FILE
    model = cls.empty(config)
    try:
        with safe_open(str(weights_path), framework="pt") as weights:
            stored_digest = (weights.metadata() or {}).get(WEIGHTS_DIGEST_KEY)
            saved_tokenizer = (weights.metadata() or {}).get(TOKENIZER_DIGEST_KEY)
            names = set(weights.keys())
            if saved is None and quantization is None:
                state = {name: weights.get_tensor(name) for name in names}
                problems = shape_mismatches(model.state_dict(), state)
                if problems:
                    raise ValueError(f"weights in {weights_path} do not fit its config: " + "; ".join(problems[:10]))
                model.load_state_dict(state, assign=True)
            else:
                model = _load_quantized(model, weights, names, saved, quantization, group_size, weights_path,
                                        backend)
    except ValueError:
        raise
    except Exception as err:
        raise ValueError(f"cannot read weights {weights_path}: {err}") from err
    model.generation_config = load_generation_config(directory) or GenerationConfig()
    model = model.to(device=device, dtype=dtype).eval()
    # the stored digest is of the file's tensors: it stands for the model's unless dtype cast
    # them or they were quantized while loading (an older bundle has none: identity() hashes
    # the weights when first asked)
    if stored_digest is not None and quantization is None and dtype is None:
        remember_digest(model, stored_digest)
    check_finite_weights(model, weights_path)
    model.tokenizer_digest = saved_tokenizer
    return model


def locate(name_or_path: str | os.PathLike) -> tuple[str, Path]:
    """Where :func:`from_pretrained` loads ``name_or_path`` from (:func:`llm.utils.pretrained.resolve`),
    checked to be there without reading it: ``("gguf", file)`` or ``("bundle", directory)``. The
    command lines call it before loading anything (the tokenizer first), so that a wrong
    ``--model`` is named as such.

    Raises:
        FileNotFoundError: no such path and no registered name (or one not fetched yet); a
            ``.gguf`` path that is no file; a file that is not ``.gguf``; a folder without
            ``config.yaml`` and ``model.safetensors`` (pointing at a training run's ``model``
            folder where there is one).
    """
    kind, directory = resolve(name_or_path)
    if kind == "gguf":
        if not directory.is_file():
            raise FileNotFoundError(f"no GGUF file at {directory}")
        return kind, directory
    if not directory.exists():
        raise FileNotFoundError(unknown_model(str(name_or_path)))
    if directory.is_file():
        raise FileNotFoundError(f"{directory} is a file but not a .gguf one: give a model folder (with "
                                f"{CONFIG_FILE}), a .gguf file or a registered name")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (directory / name).is_file():
            hint = (f" (a training run's model is in {directory / 'model'})"
                    if (directory / "model" / CONFIG_FILE).is_file() else "")
            raise FileNotFoundError(f"no {name} in {directory}: not a model saved by MosaicGPT.save_pretrained{hint}")
    return kind, directory


def check_finite_weights(model, source: str | os.PathLike) -> None:
    """Raise ValueError naming the first floating-point weight of ``model`` (parameters and
    buffers: a quantized layer's scales too) that holds NaN or infinity, and where it came from:
    a diverged training run or a corrupt file would otherwise answer with nothing or garbage.
    One pass over the float tensors: their least and largest values, which NaN and infinity
    reach (``torch.aminmax``, a third of ``isfinite(t).all()``'s time: 7 ms for a GGUF model's
    363 float tensors)."""
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if not tensor.is_floating_point() or tensor.device.type == "meta" or not tensor.numel():
            continue
        least, most = torch.aminmax(tensor.detach())
        if not (bool(torch.isfinite(least)) and bool(torch.isfinite(most))):
            bad = int((~torch.isfinite(tensor)).sum())
            raise ValueError(f"{source}: weight {name} holds {bad} NaN or infinite value(s) of {tensor.numel()}: the "
                             f"file is corrupt, or the training that wrote it diverged (a NaN loss)")


def check_tokenizer_fits(tokenizer: object, model, name: str) -> None:
    """Raise DataError (a ValueError) when ``tokenizer`` is not ``model``'s (``name``: how the
    user named it): see :func:`llm.utils.tokens.tokenizer_misfit`, with the digest of the
    tokenizer saved with the weights (``model.tokenizer_digest``, written by
    ``save_pretrained(tokenizer=...)``)."""
    problem = tokenizer_misfit(tokenizer, model.config.vocab_size, getattr(model, "tokenizer_digest", None), name)
    if problem is not None:
        raise DataError(problem)


def _read_quantization(directory: Path) -> dict | None:
    """The bundle's ``quantization.json``, or None; ValueError if it is not a JSON object."""
    path = directory / QUANTIZATION_FILE
    if not path.is_file():
        return None
    try:
        spec = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot read {path}: {err}") from err
    if not isinstance(spec, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(spec).__name__}")
    return spec


def _load_quantized(model, weights, names, saved, method, group_size, path, backend):
    """Fill the meta ``model`` from an open safetensors file: a saved quantized model
    (``saved``, its quantization.json) or float weights quantized one tensor at a time."""
    if saved is not None:
        owned = {f"{m}.{t}" for m in saved.get("quantized", []) for t in ("weight", "scales", "scales_and_zeros", "bias")}
        if EMBEDDING in saved.get("quantized", []):
            owned |= {f"{HEAD}.weight", f"{HEAD}.scales"}
    else:
        tied = model.lm_head is None
        owned = {f"{name}.weight" for name in projections(model)} | {f"{EMBEDDING if tied else HEAD}.weight"}
    plain = {name: weights.get_tensor(name) for name in names - owned}
    expected = {k: v for k, v in model.state_dict().items() if k not in owned}
    problems = shape_mismatches(expected, plain)
    if problems:
        raise ValueError(f"weights in {path} do not fit its config: " + "; ".join(problems[:10]))
    model.load_state_dict(plain, strict=False, assign=True)

    def tensor(name: str) -> torch.Tensor:
        if name not in names:
            raise ValueError(f"weights in {path} lack {name}")
        return weights.get_tensor(name)

    if saved is not None:
        try:
            quantize_like(model, saved, tensor, backend)
        except ValueError as err:
            raise ValueError(f"weights in {path} do not fit its quantization.json: {err}") from err
    else:
        quantize(model, method, group_size, weights=tensor, backend=backend)
    left = [k for k, v in model.state_dict().items() if v.device.type == "meta"]
    if left:
        raise ValueError(f"weights in {path} lack {left[:10]}")
    return model
