"""Our default decoding against llama.cpp's own `llama-bench` on SmolLM2's GGUF files (Q4_1 as
shipped, Q4_0 and Q8_0 made from the same weights by `llama-quantize`): decode tok/s of 128 new
tokens (llama-bench's tg128) and prefill tok/s of 512 tokens (pp512), the two taking turns, several
rounds, medians and the median of the per-round ratios; optionally again while a CPU-bound process
runs on one core (`--busy`), to show how much of the quiet speed each keeps on a shared machine.
Last, the memory read bandwidth each decode uses (its weights x tokens/s) against the machine's.

Ours runs as a user gets it: `MosaicGPT.from_pretrained(file)` with no flag (the file's own blocks
on our kernels, eager). Needs `make llama-tools` (llama.cpp built in .venv-peers); run it alone on
the machine: `.venv/bin/python -m benchmarks.llama_bench`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from llm.data.tokenizer import load_tokenizer
from llm.utils.pretrained import resolve
from llm.model import MosaicGPT

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / ".venv-peers" / "llama.cpp" / "bin"


def derived(source: Path, kind: str, tools: Path) -> Path:
    """SmolLM2's weights as a ``kind`` (Q4_0, Q8_0) GGUF file beside ``source``, made once by
    llama-quantize from an F32 export of the file's weights (llama.cpp's own way to a type)."""
    out = source.with_name(f"{source.stem.rsplit('.', 1)[0]}.{kind}.gguf")
    if out.is_file():
        return out
    f32 = source.with_name(f"{source.stem.rsplit('.', 1)[0]}.F32.gguf")
    if not f32.is_file():
        from llm.formats.gguf import save_gguf

        save_gguf(MosaicGPT.from_pretrained(source, quantization="none"), load_tokenizer(str(source)), f32, "f32")
    subprocess.run([str(tools / "llama-quantize"), str(f32), str(out), kind], check=True, capture_output=True)
    return out


def llama_bench(tools: Path, path: Path, threads: int) -> tuple[float, float]:
    """(tg128, pp512) tokens/s of one llama-bench run of one repetition each."""
    out = subprocess.run([str(tools / "llama-bench"), "-m", str(path), "-t", str(threads), "-p", "512", "-n", "128",
                          "-r", "1", "-o", "json"], check=True, capture_output=True, text=True).stdout
    rows = json.loads(out)
    tg = next(r["avg_ts"] for r in rows if r["n_gen"] == 128)
    pp = next(r["avg_ts"] for r in rows if r["n_prompt"] == 512)
    return tg, pp


@torch.no_grad()
def ours(model: MosaicGPT, start: int) -> tuple[float, float]:
    """(decode, prefill) tokens/s: 128 new tokens after one (as tg128, timed from the first new
    token to the last), and one forward of 512 tokens."""
    from benchmarks.generate import TokenClock

    clock = TokenClock()
    model.generate(torch.tensor([[start]]), max_new_tokens=129, do_sample=False, eos_token_id=None, stop_strings=None,
                   streamer=clock)
    ids = torch.randint(0, model.config.vocab_size, (1, 512), generator=torch.Generator().manual_seed(0))
    began = time.perf_counter()
    model(ids, logits_to_keep=1)
    return clock.decode_tokens_per_s(), 512 / (time.perf_counter() - began)


def read_bandwidth(threads: int, gib: float = 1.0, repeats: int = 5) -> float:
    """The machine's memory read bandwidth in GB/s: the best of ``repeats`` sums over a float32
    array of ``gib`` GiB (far past the caches) on ``threads`` threads (torch's reduction)."""
    torch.set_num_threads(threads)
    x = torch.ones(int(gib * 2**30) // 4)
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - began)
    return x.numel() * 4 / best / 1e9


def step_bytes(model: MosaicGPT) -> int:
    """Bytes of the model's weights (parameters and buffers, each tensor once): what a decode
    step reads, all of it, but for the embedding's other rows (a tied output layer reads them)
    and the float ``scales`` a layer on our kernels keeps beside the ``kernel_scales`` it reads.
    Tensors are counted, not their storages: a load puts the blocks' kernel tensors in one
    region of huge pages (``cpu_quant.HugePages``), larger than they are."""
    seen, total = set(), 0

    def count(tensor: torch.Tensor) -> None:
        nonlocal total
        key = (tensor.data_ptr(), tensor.numel() * tensor.element_size())
        if key not in seen:
            seen.add(key)
            total += key[1]

    for module in model.modules():
        scales = getattr(module, "scales", None)
        if getattr(module, "kernel", None) == "llm" and hasattr(module, "kernel_scales") and scales is not None:
            seen.add((scales.data_ptr(), scales.numel() * scales.element_size()))
    for tensor in [*model.parameters(), *model.buffers()]:
        count(tensor)
    for module in model.modules():  # quantized layers keep their packed blocks as attributes
        for value in vars(module).values():
            if isinstance(value, torch.Tensor):
                count(value)
    return total


def gguf_tensor_bytes(path: Path) -> int:
    """Bytes of a GGUF file's tensor data: what llama.cpp's decode step reads."""
    from llm.utils.gguf import read_gguf

    return sum(int(t.n_bytes) for t in read_gguf(path).tensors)


def rounds(fns: dict, n: int) -> dict[str, list[tuple[float, float]]]:
    """Every call ``n`` times after a warm-up, taking turns, each round starting one further on."""
    names = list(fns)
    for name in names:
        fns[name]()
    out = {name: [] for name in names}
    for r in range(n):
        for name in names[r % len(names):] + names[:r % len(names)]:
            out[name].append(fns[name]())
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pretrained", default="smollm2-135m-instruct")
    parser.add_argument("--types", default="Q4_1,Q4_0,Q8_0", help="GGUF types: the shipped file's and others made")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--tools", type=Path, default=TOOLS, help="where llama-bench and llama-quantize are")
    parser.add_argument("--busy", action="store_true", help="also measure with a CPU-bound process on one core")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if not (args.tools / "llama-bench").is_file():
        parser.error(f"no llama-bench in {args.tools}: run `make llama-tools`")
    torch.set_num_threads(args.threads)
    source = resolve(args.pretrained)[1]
    shipped = source.stem.rsplit(".", 1)[-1]
    start = load_tokenizer(args.pretrained).bos_token_id or 1
    table = []
    for kind in args.types.split(","):
        path = source if kind == shipped else derived(source, kind, args.tools)
        model = MosaicGPT.from_pretrained(path)
        conditions = ["quiet", "busy"] if args.busy else ["quiet"]
        for condition in conditions:
            hog = None
            torch.ops.llm.set_pace(0, 16)  # each condition starts from the kernels' first guess: all threads
            if condition == "busy":  # one core's worth of someone else's work, pinned to core 0
                hog = subprocess.Popen([sys.executable, "-c", "import os; os.sched_setaffinity(0, {0})\nwhile True: pass"])
            try:
                got = rounds({"ours": lambda: ours(model, start),
                              "llama.cpp": lambda: llama_bench(args.tools, path, args.threads)}, args.rounds)
            finally:
                if hog is not None:
                    hog.kill()
            row = {"file": kind, "condition": condition, "bytes": (step_bytes(model), gguf_tensor_bytes(path))}
            for i, what in enumerate(("tg128", "pp512")):
                a, b = [g[i] for g in got["ours"]], [g[i] for g in got["llama.cpp"]]
                ratios = [x / y for x, y in zip(a, b)]
                row[what] = (statistics.median(a), statistics.median(b), statistics.median(ratios), min(ratios),
                             max(ratios))
            table.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    bandwidth = read_bandwidth(args.threads)
    print(f"{args.rounds} rounds taking turns, {args.threads} threads; ratio: median of the per-round ratios (range)\n")
    print("| file | condition | ours tg128 | llama-bench tg128 | ratio | ours pp512 | llama-bench pp512 | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in table:
        cells = []
        for what in ("tg128", "pp512"):
            a, b, mid, lo, hi = row[what]
            cells += [f"{a:.1f}", f"{b:.1f}", f"{mid:.2f} ({lo:.2f}-{hi:.2f})"]
        print(f"| {row['file']} | {row['condition']} | " + " | ".join(cells) + " |")
    # decoding one token reads every weight once: weights x tokens/s is the read bandwidth a
    # decode uses, and the machine's bandwidth over the weights is the most tokens/s it allows
    print(f"\nmemory read bandwidth ({args.threads} threads, a 1 GiB sum): {bandwidth:.1f} GB/s\n")
    print("| file | weights read per token, ours / llama.cpp (MB) | tg128 x weights, ours / llama.cpp (GB/s) "
          "| tokens/s the bandwidth allows ours | 1.5x llama-bench tg128 |")
    print("| --- | --- | --- | --- | --- |")
    for row in table:
        if row["condition"] != "quiet":
            continue
        (a, b, *_), (mine, theirs) = row["tg128"], row["bytes"]
        print(f"| {row['file']} | {mine / 1e6:.1f} / {theirs / 1e6:.1f} | {a * mine / 1e9:.1f} / {b * theirs / 1e9:.1f} "
              f"| {bandwidth * 1e9 / mine:.0f} | {1.5 * b:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
