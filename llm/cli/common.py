"""What the command lines share: one-line errors, argument types, loading a YAML config with
``key=value`` overrides."""

from __future__ import annotations

import argparse
import textwrap
from typing import Any

#: ``--dtype`` choices: names of torch dtypes (``getattr(torch, name)``).
DTYPE_NAMES = ("bfloat16", "float16", "float32")


class CliError(ValueError):
    """A bad command-line input, printed as one line with exit status 2."""


def model_problem(name: str) -> str | None:
    """Why ``--model NAME`` cannot load (no such path or registered name, a folder that is not a
    model, a file that is not ``.gguf``: :func:`llm.bundle.locate`), as one line, or None; checked
    before anything loads."""
    from llm.bundle import locate

    try:
        locate(name)
    except FileNotFoundError as err:
        return str(err)
    return None


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line, ``PROG: error: ...``, with exit status 2 and without the
    usage block (``--help`` shows it)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(str(message).splitlines())}\n")


def describe(doc: str) -> str:
    """A command's ``--help`` description: the first paragraph of its module docstring as one
    paragraph wrapped at 88 columns, without reStructuredText's double backquotes."""
    return textwrap.fill(" ".join(doc.strip().split("\n\n")[0].split()).replace("``", ""), width=88)


def integer(minimum: int = 1, maximum: int | None = None):
    """An argparse type: an integer in [``minimum``, ``maximum``]; anything else is a one-line error
    saying so."""

    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be an integer <= {maximum}, got {value}")
        return value

    return convert


QUANTIZE_HELP = ("weight-only quantization: int8, int4, gguf (a .gguf file's own blocks) or none (a .gguf file "
                 "dequantized to floats); default: as stored (a quantized .gguf file on its own blocks)")
BACKEND_HELP = ("whose kernels quantized layers take: auto (ours on x86-64 CPUs with AVX2 or AVX512-VNNI, torch's "
                "elsewhere), llm (ours) or torch; default auto")
THREADS_HELP = ("compute threads (default: torch's, one per core; on a machine where other processes are busy, "
                "fewer threads than cores decode faster)")


def add_model_arguments(p: argparse.ArgumentParser, *, compile_help: str) -> None:
    """The flags of every command that loads a model to run it: --device, --dtype, --quantize,
    --backend, --threads, --compile."""
    p.add_argument("--device", type=torch_device, default="cpu", help="cpu, cuda, cuda:N or mps")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="float32",
                   help="dtype of the weights that are not quantized and of activations (default float32)")
    p.add_argument("--quantize", choices=["none", "int8", "int4", "gguf"], help=QUANTIZE_HELP)
    p.add_argument("--backend", choices=["auto", "llm", "torch"], default="auto", help=BACKEND_HELP)
    p.add_argument("--threads", type=integer(), help=THREADS_HELP)
    p.add_argument("--compile", action="store_true", help=compile_help)


def set_threads(threads: int | None) -> None:
    """``torch.set_num_threads(threads)`` when given (our kernels' thread team follows torch's)."""
    if threads:
        import torch

        torch.set_num_threads(threads)


def load_model(args: argparse.Namespace):
    """(tokenizer, model) of ``args.model`` with the model flags of :func:`add_model_arguments`
    (``--device``, ``--dtype``, ``--quantize``, ``--backend``), on ``--threads`` threads.

    The tokenizer is loaded first: its transient memory (a GGUF file's parsed vocabulary) then
    comes before the model's, not on top of it. Both load in
    :func:`llm.formats.gguf.reader.preloading` (one parse of a GGUF file's header).

    Raises:
        ValueError / FileNotFoundError: as ``load_tokenizer`` and ``MosaicGPT.from_pretrained``,
            and when the tokenizer does not fit the model (``check_tokenizer_fits``).
    """
    import torch

    from llm.bundle import check_tokenizer_fits
    from llm.data.tokenizer import load_tokenizer
    from llm.formats.gguf.reader import preloading
    from llm.model import MosaicGPT

    set_threads(args.threads)
    options = {"device": args.device, "quantization": args.quantize, "backend": args.backend}
    with preloading(args.model):
        tokenizer = load_tokenizer(args.model)
        model = MosaicGPT.from_pretrained(args.model, dtype=getattr(torch, args.dtype), **options)
    check_tokenizer_fits(tokenizer, model, args.model)
    return tokenizer, model


def torch_device(text: str):
    """An argparse type: a ``torch.device`` that exists and works on this machine."""
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"unknown device {text!r}; use cpu, cuda, cuda:N or mps") from None
    if device.type == "meta":
        raise argparse.ArgumentTypeError("'meta' holds no weights; use cpu, cuda, cuda:N or mps")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise argparse.ArgumentTypeError("device 'mps' is not available on this machine (it needs Apple silicon)")
    try:
        torch.empty(1, device=device)
    except Exception as err:  # by backend: RuntimeError, AssertionError, NotImplementedError, ...
        reason = (str(err).splitlines() or [type(err).__name__])[0].split(". ")[0]
        raise argparse.ArgumentTypeError(f"device {text!r} is not available on this machine ({reason})") from None
    return device


def load_yaml_config(path: str, overrides: list[str]) -> dict[str, Any]:
    """The YAML file at ``path`` merged with omegaconf dotlist ``overrides`` (``a.b=1``), as a plain dict.

    Raises:
        CliError: for a missing or unreadable file, YAML that is not a mapping, or an override that
            is not ``key=value``.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException
    from yaml import YAMLError

    bad = [item for item in overrides if "=" not in item or item.startswith("=")]
    if bad:
        raise CliError(f"overrides must be key=value (e.g. max_duration=100ba), got {bad[0]!r}")
    try:
        base = OmegaConf.load(path)
    except FileNotFoundError:
        raise CliError(f"no config file {path}") from None
    except (OSError, YAMLError, OmegaConfBaseException, UnicodeDecodeError) as error:
        raise CliError(f"cannot read the config {path}: {' '.join(str(error).split())}") from None
    if not OmegaConf.is_dict(base):
        raise CliError(f"{path} must hold a mapping of config keys, not {type(OmegaConf.to_object(base)).__name__}")
    for item in overrides:
        try:
            OmegaConf.from_dotlist([item])
        except (OmegaConfBaseException, YAMLError) as error:
            raise CliError(f"bad override {item!r}: {' '.join(str(error).split())}") from None
    try:
        merged = OmegaConf.merge(base, OmegaConf.from_dotlist(overrides))
        return OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as error:
        raise CliError(f"bad override or interpolation: {' '.join(str(error).split())}") from None
