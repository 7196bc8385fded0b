"""Our CPU int4/int8 kernels (llm/kernels/cpu_quant.cpp) against torch's, on SmolLM2's GGUF file,
next to llama.cpp: decode tokens/s at batch 1 (timed inside each call, from the first new token to
the last; the median of rounds, and the median of the per-round ratios to llama.cpp), prefill
tokens/s and held-out bits per byte, the engines taking turns in one process. Needs
llama-cpp-python: run it with `.venv-peers/bin/python -m benchmarks.cpu_kernels` after
`make bench-peers`, alone on the machine.
"""

import argparse
import os
import statistics
import sys
import tempfile

import torch

from llm.data.tokenizer import load_tokenizer
from llm.utils.pretrained import resolve
from benchmarks.generate import _timed_interleaved, decode_rounds, versus
from benchmarks.generate_fast import (_generate, bits_per_byte, clocked, eval_blocks, llama_nll, load_ours, ours_nll,
                                       prompt_ids)
from benchmarks.peers import LlamaCpp, llama_cpp_missing
from llm.kernels import cpu_quant


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pretrained", default="smollm2-135m-instruct")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5, help="rounds of every engine taking turns")
    parser.add_argument("--bpb-blocks", type=int, default=8)
    parser.add_argument("--bpb-block-len", type=int, default=256)
    parser.add_argument("--engine", action="append", default=[],
                        help="a row to run besides llama.cpp, e.g. 'gguf, ours compiled' (repeatable; default: all)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.new_tokens < 2:
        parser.error(f"--repeats must be >= 1 and --new-tokens >= 2 (a decode rate needs two new tokens), "
                     f"got {args.repeats} and {args.new_tokens}")
    for why in (llama_cpp_missing(), cpu_quant.unavailable()):
        if why:
            parser.error(why)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="llm-bench-inductor-"))
    tokenizer = load_tokenizer(args.pretrained)
    prompt = prompt_ids(tokenizer)
    ids, n = torch.tensor([prompt]), args.new_tokens
    path = str(resolve(args.pretrained)[1])
    rows = [f"{q}, {kernels}{compiled}" for q in ("gguf", "int8") for kernels in ("torch's kernels", "ours")
            for compiled in ("", " compiled")]
    unknown = set(args.engine) - set(rows)
    if unknown:
        parser.error(f"unknown --engine {sorted(unknown)}: choose from {rows}")
    rows = [row for row in rows if not args.engine or row in args.engine]
    models = {}
    for row in rows:
        name = row.removesuffix(" compiled")
        if name not in models:
            models[name] = load_ours(args.pretrained, name.split(",")[0], "torch" if "torch's" in name else "llm")
    threads = torch.get_num_threads()
    llama = LlamaCpp(path, n_threads=threads, n_ctx=len(prompt) + n + 16, n_seq_max=1)
    calls = {row: (lambda k, clock=None, m=models[row.removesuffix(" compiled")], c=row.endswith(" compiled"):
                   _generate(False, m, ids, k, c, tokenizer, clock)) for row in rows}
    calls["llama.cpp"] = lambda k, clock=None: torch.from_numpy(llama.greedy([prompt], k, on_token=clock and clock.tick))
    for call in calls.values():
        call(2)  # compile (and warm) before timing
    names = list(calls)
    first = _timed_interleaved([lambda f=calls[m]: f(1) for m in names], args.repeats, min_total_s=1.0)
    decoded = dict(zip(names, decode_rounds([lambda f=clocked(calls[m], 1): f(n) for m in names], args.repeats)))
    blocks, n_bytes = eval_blocks(tokenizer, args.bpb_blocks, args.bpb_block_len)
    bpb = {name: bits_per_byte(ours_nll(m, blocks), n_bytes) for name, m in models.items()}
    bpb["llama.cpp"] = bits_per_byte(llama_nll(LlamaCpp(path, n_threads=threads, n_ctx=args.bpb_block_len + 16),
                                               blocks), n_bytes)
    print(f"decode: median of {args.repeats} rounds taking turns, {n} new tokens, timed from the first new token "
          "to the last; vs llama.cpp: median of the per-round ratios (range in brackets)\n")
    print("| engine | decode tok/s, batch 1 | vs llama.cpp | prefill tok/s | bits per byte |")
    print("| --- | --- | --- | --- | --- |")
    for m, (t1, _) in zip(names, first):
        quality = bpb.get(m.removesuffix(" compiled"))
        mid, low, high = versus(decoded[m][0], decoded["llama.cpp"][0])
        print(f"| {m} | {statistics.median(decoded[m][0]):.1f} | {mid:.2f} ({low:.2f}-{high:.2f}) | "
              f"{len(prompt) / t1:.0f} | {quality:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
