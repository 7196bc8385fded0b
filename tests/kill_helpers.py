"""Run an ``llm`` command that SIGKILLs itself at the Nth call of a function, as a crash or the OOM
killer would stop it there: ``python -m tests.kill_helpers MODULE:QUALNAME N llm-args...``.

The function is wrapped in place (a module attribute, or a class attribute ``Class.method``); its Nth
call kills the process on entry, before it does anything.
"""

import functools
import importlib
import os
import signal
import sys


def kill_at(target: str, n: int) -> None:
    module_name, _, qualname = target.partition(":")
    owner = importlib.import_module(module_name)
    *path, name = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    original, calls = getattr(owner, name), [0]

    @functools.wraps(original)
    def killing(*args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)

    setattr(owner, name, killing)


if __name__ == "__main__":
    kill_at(sys.argv[1], int(sys.argv[2]))
    from llm.cli.main import main

    sys.exit(main(sys.argv[3:]))
