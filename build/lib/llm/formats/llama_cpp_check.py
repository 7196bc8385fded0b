"""Does llama.cpp decode a GGUF export as we do? Greedy tokens of ours and of llama-cpp-python, side by side.

Runs in the peers' environment of ``make bench-peers`` (llama-cpp-python is never in ``.venv``):
``.venv-peers/bin/python scripts/check_llama_cpp.py FILE.gguf --prompt TEXT``. Exits 0 when the
tokens agree, 1 when they part (printing where).
"""

from __future__ import annotations

import argparse
import sys

import torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="check_llama_cpp.py", description=__doc__.splitlines()[0])
    p.add_argument("gguf", help="the .gguf file (an export of scripts/export.py --to gguf)")
    p.add_argument("--prompt", default="ROMEO:")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    from llama_cpp import Llama

    from llm.data.tokenizer import load_tokenizer
    from llm.model import MosaicGPT

    model, tokenizer = MosaicGPT.from_pretrained(args.gguf), load_tokenizer(args.gguf)
    ids = tokenizer(args.prompt, add_special_tokens=False).input_ids
    ours = model.generate(torch.tensor([ids]), max_new_tokens=args.max_new_tokens)[0, len(ids):].tolist()
    llama = Llama(model_path=args.gguf, n_ctx=len(ids) + args.max_new_tokens + 8, n_threads=args.threads,
                  verbose=False)
    theirs = []
    for token in llama.generate(ids, temp=0.0, top_k=1, reset=True):
        theirs.append(token)
        if len(theirs) == len(ours):
            break
    llama.close()
    print(f"ours:      {tokenizer.decode(ours)!r}")
    print(f"llama.cpp: {tokenizer.decode(theirs)!r}")
    same = ours == theirs
    where = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    print(f"{len(ours)} greedy tokens: " + ("identical" if same else f"they part at token {where}"))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
