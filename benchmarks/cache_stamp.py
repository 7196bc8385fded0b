"""What a cache's model stamp costs while decoding (``python -m benchmarks.cache_stamp``).

Every forward with a cache calls :meth:`llm.cache.Cache.claim`, which reads the model's
``weights_version`` (the sum of its tensors' version counters) to refuse keys and values computed
before the weights were written. This benchmark decodes the same greedy tokens with the check and
with ``claim`` replaced by a no-op, taking turns, and prints the median per-round ratio of decode
tokens/s: the check is cheap enough when the ratio is 1 within the rounds' spread.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys

import torch

from benchmarks.generate import TokenClock, decode_rounds, versus
from llm.cache import Cache
from llm.data.tokenizer import load_tokenizer
from llm.generation.generate import generate
from llm.model import MosaicGPT


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cache_stamp", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="a model name, GGUF file or bundle")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = MosaicGPT.from_pretrained(args.model)
    tokenizer = load_tokenizer(args.model)
    ids = tokenizer("The quick brown fox jumps over the lazy dog. Once upon a time,", return_tensors="pt").input_ids
    checked_claim = Cache.claim

    def decode(claim):
        def call():
            Cache.claim = claim
            try:
                clock = TokenClock()
                out = generate(model, ids, max_new_tokens=args.new_tokens, do_sample=False, streamer=clock)
            finally:
                Cache.claim = checked_claim
            return out, clock.decode_tokens_per_s()
        return call

    (checked, with_check), (unchecked, without_check) = decode_rounds(
        [decode(checked_claim), decode(lambda self, model: None)], args.rounds)
    if not torch.equal(with_check, without_check):
        raise SystemExit("the two runs decoded different tokens")
    median, low, high = versus(checked, unchecked)
    result = {"model": args.model, "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
              "new_tokens": args.new_tokens, "rounds": args.rounds,
              "tokens_per_s_with_check": sorted(checked)[len(checked) // 2],
              "tokens_per_s_without": sorted(unchecked)[len(unchecked) // 2],
              "ratio_median": median, "ratio_low": low, "ratio_high": high}
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
