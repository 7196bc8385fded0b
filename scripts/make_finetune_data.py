"""Write the fine-tuning pairs shipped in configs/data: ``python scripts/make_finetune_data.py [OUT_DIR]``.

Each example is a cue line and the reply to it (see :mod:`llm.data.cues`): 1000 from the
training plays and 200 from the held-out plays, drawn with seed 0.
"""

import sys
from pathlib import Path

from llm.data.cues import make_cue_dataset, write_jsonl

SIZES = {"train": 1000, "validation": 200}


def main(argv: list[str]) -> int:
    out_dir = Path(argv[0]) if argv else Path(__file__).resolve().parents[1] / "configs" / "data"
    for split, n in SIZES.items():
        examples = make_cue_dataset(split, n, seed=0)
        path = out_dir / f"shakespeare-cues-{split}.jsonl"
        write_jsonl(examples, path)
        print(f"{path}: {len(examples)} examples")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
