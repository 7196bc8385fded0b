"""The whole command as a user sees it: `scripts/generate.py` on a GGUF file with default flags
against llama.cpp's Python binding (llama-cpp-python, from `make bench-peers`) on the same file,
prompt (in the file's chat template) and number of new tokens, each a fresh process. Both go on
past the end-of-text token (ours `--ignore-eos`, theirs the token's logit at -inf, llama.cpp's
`--ignore-eos`), so that every round writes the same number of tokens whatever its sampled text;
a round that writes fewer is said.

For each: wall time from start to exit, time to the first streamed byte of the answer (model load
included), peak RSS (the child's ``ru_maxrss``), and how many tokens it wrote; and, as the floor
under them, a process that only imports torch, one that imports llm and one that imports
llama_cpp. The processes take turns, round after round; each figure is the median over the
rounds. The wall-time ratio is also given per round (median and range): a round's two commands
run back to back, so a machine whose speed moves between rounds moves both. Memory is also given
as (peak - peak of ``import torch``) / file size, the issue's measure of what the model costs
beyond the framework.

Run it alone on the machine: `.venv/bin/python -m benchmarks.command [--rounds 5]`.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEERS_PYTHON = ROOT / ".venv-peers" / "bin" / "python"
PROMPT = "Write a long story about a dragon who learns to bake bread."

# llama-cpp-python's chat completion streams the answer; greedy, the file's own chat template, the
# end-of-text token forbidden (llama.cpp's --ignore-eos) so that it writes as many tokens as ours.
LLAMA_CPP = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_threads=int(sys.argv[4]), n_ctx=1024, verbose=False)
n = 0
for chunk in llm.create_chat_completion([{"role": "user", "content": sys.argv[2]}], max_tokens=int(sys.argv[3]),
                                        temperature=0.0, stream=True, logit_bias={llm.token_eos(): float("-inf")}):
    text = chunk["choices"][0]["delta"].get("content")
    if text:
        n += 1
        print(text, end="", flush=True)
print(f"\\n[tokens {n}]", file=sys.stderr)
"""


def run(command: list[str]) -> dict:
    """Wall seconds to exit and to the first byte on stdout, and peak RSS (MiB) of one child."""
    start = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    first, out, err = None, bytearray(), bytearray()
    with selectors.DefaultSelector() as sel:
        sel.register(child.stdout, selectors.EVENT_READ, out)
        sel.register(child.stderr, selectors.EVENT_READ, err)
        while sel.get_map():
            for key, _ in sel.select():
                data = os.read(key.fileobj.fileno(), 65536)
                if not data:
                    sel.unregister(key.fileobj)
                    continue
                if key.data is out and first is None:
                    first = time.perf_counter() - start
                key.data.extend(data)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode:
        raise RuntimeError(f"{command[:3]} failed ({child.returncode}): {err.decode()[-2000:]}")
    return {"wall_s": wall, "first_byte_s": first, "peak_mib": usage.ru_maxrss / 1024, "stderr": err.decode()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a .gguf file (default: the registered smollm2-135m-instruct's, from llm fetch)")
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    if args.model is None:  # found by a child: a child's peak RSS counts the parent's (vfork + exec), so
        # this process must not import torch
        args.model = subprocess.run([sys.executable, "-c", "from llm.utils.pretrained import registered_path; "
                                     "print(registered_path('smollm2-135m-instruct'))"],
                                    check=True, capture_output=True, text=True, cwd=ROOT).stdout.strip()
    if not PEERS_PYTHON.is_file():
        p.error(f"no {PEERS_PYTHON}: run `make bench-peers` first")
    py = sys.executable
    commands = {
        "import torch": [py, "-c", "import torch"],
        "import llm": [py, "-c", "import llm"],
        "import llama_cpp": [str(PEERS_PYTHON), "-c", "import llama_cpp"],
        "ours: scripts/generate.py": [py, "scripts/generate.py", "--model", args.model, "--prompt", args.prompt,
                                      "--chat", "--stream", "--ignore-eos", "--max-new-tokens", str(args.max_new_tokens),
                                      "--threads", str(args.threads)],
        "llama-cpp-python": [str(PEERS_PYTHON), "-c", LLAMA_CPP, args.model, args.prompt, str(args.max_new_tokens),
                             str(args.threads)],
    }
    runs = {name: [] for name in commands}
    for r in range(args.rounds):
        for name, command in commands.items():
            runs[name].append(run(command))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {v[-1]['wall_s']:.2f} s" for n, v in runs.items()),
              file=sys.stderr, flush=True)
    size_mib = Path(args.model).stat().st_size / 2**20
    torch_peak = statistics.median(x["peak_mib"] for x in runs["import torch"])
    rows = {}
    for name, results in runs.items():
        row = {k: statistics.median(x[k] for x in results if x[k] is not None)
               for k in ("wall_s", "first_byte_s", "peak_mib") if any(x[k] is not None for x in results)}
        if name.startswith("ours"):
            counts = [int(x["stderr"].split("decode: ")[1].split()[0]) for x in results]
            row["over_torch_per_file"] = (row["peak_mib"] - torch_peak) / size_mib
        elif name == "llama-cpp-python":
            counts = [int(x["stderr"].split("[tokens ")[1].split("]")[0]) for x in results]
        else:
            counts = None
        if counts is not None:  # the fewest a round wrote: every round should write them all
            row["tokens"] = min(counts)
            if row["tokens"] != args.max_new_tokens:
                print(f"warning: {name} wrote {counts} tokens, not {args.max_new_tokens} each round", file=sys.stderr)
        rows[name] = row
    ours, peer = rows["ours: scripts/generate.py"], rows["llama-cpp-python"]
    print(f"\n{Path(args.model).name} ({size_mib:.0f} MiB), {args.max_new_tokens} new tokens, "
          f"{args.threads} threads, median of {args.rounds} rounds\n")
    print("| process | wall s | first byte s | peak MiB | tokens (fewest) |\n| --- | --- | --- | --- | --- |")
    for name, row in rows.items():
        first = f"{row['first_byte_s']:.2f}" if "first_byte_s" in row else ""
        print(f"| {name} | {row['wall_s']:.2f} | {first} | {row['peak_mib']:.0f} | {row.get('tokens', '')} |")
    # each round's ratio: the two ran back to back, so a machine that slows between rounds moves both
    ratios = sorted(a["wall_s"] / b["wall_s"] for a, b in zip(runs["ours: scripts/generate.py"], runs["llama-cpp-python"]))
    print(f"\nours / llama-cpp-python wall: {ours['wall_s'] / peer['wall_s']:.2f}x (per round: median "
          f"{statistics.median(ratios):.2f}x, {ratios[0]:.2f}-{ratios[-1]:.2f}x); "
          f"import llm - import torch: {rows['import llm']['wall_s'] - rows['import torch']['wall_s']:+.2f} s; "
          f"(our peak - import torch's peak) / file: {ours['over_torch_per_file']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
