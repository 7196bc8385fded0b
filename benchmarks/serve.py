"""Load on an OpenAI-compatible server: 1, 4, 16 and 32 concurrent clients on a fixed mix of chat prompts.

Starts ``scripts/serve.py`` (and, when the peers' environment of ``make bench-peers`` exists,
``llama-cpp-python``'s OpenAI server and llama.cpp's own ``llama-server`` with ``--parallel N``
continuous batching, on the same GGUF file), sends every prompt through
``/v1/chat/completions`` with ``stream: true`` (greedy, so every run decodes the same tokens), and
prints per server and concurrency: aggregate output tokens/s, time to first token p50/p95, time
between tokens p50/p95 (the gaps between a stream's chunks, over every stream), and the throughput
against the same requests sent one after another. The mix is short chat turns and a few long
prompts (a passage to summarize, ~300 tokens), as a chat service sees; a level of N clients sends
at least 2N requests, so that clients that finish ask again and requests join a running batch.

Then batch invariance: a greedy request with ``logprobs`` alone, and the same request among 15
others sent at once; whether its tokens and log probabilities are bit-identical (the largest
difference otherwise). The servers take turns (one runs while the other is stopped), so each has
the machine alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from llm.utils.pretrained import registered_path

PEERS_PYTHON = Path(".venv-peers/bin/python")  # made by `make bench-peers` in the checkout's root
LLAMA_SERVER = Path(".venv-peers/llama.cpp/bin/llama-server")  # made by `make llama-tools`

#: Real questions of different lengths and answers (the same for every server and run).
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a ten-year-old.",
    "Give me three tips for learning to cook.",
    "What is the difference between a virus and a bacterium?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "How do I make a cup of green tea?",
    "Name five animals that live in the Arctic.",
    "Why is the sky blue?",
    "Write a short poem about autumn leaves.",
    "What are the planets of the solar system?",
    "How does a bicycle stay upright?",
    "Suggest a name for a friendly robot and say why.",
    "What should I pack for a weekend hiking trip?",
    "Explain what a prime number is, with examples.",
    "Tell me a fun fact about octopuses.",
]

PASSAGE = (
    "Bread is one of the oldest prepared foods. Evidence from thirty thousand years ago in Europe shows starch "
    "residue on rocks used for pounding plants, and it is possible that during this time starch extract from the "
    "roots of plants was spread on a flat rock, placed over a fire and cooked into a primitive form of flatbread. "
    "Around ten thousand years ago, with the dawn of the Neolithic age and the spread of agriculture, grains became "
    "the mainstay of making bread. Yeast spores occur everywhere, including on the surface of cereal grains, so any "
    "dough left to rest will become naturally leavened. There were multiple sources of leavening available for "
    "early bread. Airborne yeasts could be harnessed by leaving uncooked dough exposed to air for some time before "
    "cooking. Pliny the Elder reported that the Gauls and Iberians used the foam skimmed from beer to produce a "
    "lighter kind of bread than other peoples. Parts of the ancient world that drank wine instead of beer used a "
    "paste composed of grape juice and flour that was allowed to begin fermenting, or wheat bran steeped in wine, "
    "as a source for yeast. The most common source of leavening was to retain a piece of dough from the previous "
    "day to utilize as a form of sourdough starter. In the nineteenth century the Chorleywood process and other "
    "industrial methods changed how most bread was made, replacing long fermentation with intense mechanical "
    "working of the dough, and bakers today debate which gives the better loaf, the faster bread or the older, "
    "slower one that many small bakeries have returned to."
)
#: A few long prompts among the short ones.
LONG_PROMPTS = [f"Summarize this text in three sentences:\n\n{PASSAGE}",
                f"List the sources of leavening this text mentions:\n\n{PASSAGE}"]
MIX = PROMPTS[:8] + LONG_PROMPTS[:1] + PROMPTS[8:] + LONG_PROMPTS[1:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _percentile(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


class ServerProcess:
    """A server in a subprocess, up once ``/health`` answers 200 (or ``/v1/models`` for the peer)."""

    def __init__(self, command: list[str], port: int, ready_path: str, timeout_s: float = 600):
        self.port, self.url = port, f"http://127.0.0.1:{port}"
        self.log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-serve-{port}.log", "w")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{command[:3]} exited with {self.process.returncode}; see {self.log.name}")
            try:
                if httpx.get(self.url + ready_path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{command[:3]} did not come up in {timeout_s:.0f} s; see {self.log.name}")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


async def _one(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int,
               extra: dict | None = None) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
    start = time.perf_counter()
    first, tokens, pieces, last, gaps, text = None, None, 0, None, [], []
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if data.get("usage"):
                tokens = data["usage"]["completion_tokens"]
            for choice in data.get("choices") or ():
                if (choice.get("delta") or {}).get("content"):
                    text.append(choice["delta"]["content"])
                    pieces += 1
                    now = time.perf_counter()
                    if first is None:
                        first = now - start
                    else:
                        gaps.append(now - last)
                    last = now
    latency = time.perf_counter() - start
    return {"ttft": first if first is not None else latency, "latency": latency,
            "tokens": tokens if tokens is not None else pieces, "gaps": gaps, "text": "".join(text)}


async def _load(url: str, model: str, prompts: list[str], clients: int, max_tokens: int,
                extra: dict | None = None) -> dict:
    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results = []

    async def client_loop(client):
        while not queue.empty():
            results.append(await _one(client, url, model, queue.get_nowait(), max_tokens, extra))

    start = time.perf_counter()
    # a connection per request: llama-server closes idle keep-alive connections, which a reused one
    # would meet as "Server disconnected" (on localhost a new connection costs well under a millisecond)
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
    wall = time.perf_counter() - start
    ttft = [r["ttft"] for r in results]
    latency = [r["latency"] for r in results]
    gaps = [g for r in results for g in r["gaps"]] or [0.0]
    tokens = sum(r["tokens"] for r in results)
    return {"clients": clients, "requests": len(results), "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "ttft_p50": _percentile(ttft, 50), "ttft_p95": _percentile(ttft, 95),
            "tbt_p50": _percentile(gaps, 50), "tbt_p95": _percentile(gaps, 95),
            "latency_p50": _percentile(latency, 50), "latency_p95": _percentile(latency, 95),
            "texts": sorted(r["text"] for r in results)}


def measure(url: str, model: str, *, concurrency: tuple[int, ...], max_tokens: int, rounds: int) -> list[dict]:
    """Every concurrency level over the mix (``rounds`` times, and at least twice the clients'
    number of requests), after one warm-up request."""
    asyncio.run(_load(url, model, PROMPTS[:1], 1, 8))
    rows = []
    for clients in concurrency:
        count = max(len(MIX) * rounds, 2 * clients)
        prompts = [MIX[i % len(MIX)] for i in range(count)]
        rows.append(asyncio.run(_load(url, model, prompts, clients, max_tokens)))
        print(f"  {clients:>2} clients: {rows[-1]['tokens_per_s']:.1f} tokens/s", file=sys.stderr, flush=True)
    sequential = next(r for r in rows if r["clients"] == 1)["tokens_per_s"]
    for row in rows:
        row["vs_sequential"] = row["tokens_per_s"] / sequential
    return rows


def table(results: dict[str, list[dict]]) -> str:
    lines = ["| server | clients | output tokens/s | vs one after another | TTFT p50 / p95 (s) | "
             "time between tokens p50 / p95 (ms) |", "|---|---|---|---|---|---|"]
    for name, rows in results.items():
        for r in rows:
            lines.append(f"| {name} | {r['clients']} | {r['tokens_per_s']:.1f} | {r['vs_sequential']:.2f}x | "
                         f"{r['ttft_p50']:.2f} / {r['ttft_p95']:.2f} | {1e3 * r['tbt_p50']:.0f} / "
                         f"{1e3 * r['tbt_p95']:.0f} |")
    return "\n".join(lines)


#: Copy-heavy requests (an answer that repeats much of its prompt), where prompt-lookup drafts pay.
EDITS = [f"Repeat this text word for word, but write 'loaf' wherever it says 'bread':\n\n{PASSAGE}",
         f"Copy the following text exactly, then stop:\n\n{PASSAGE}"]


def speculation(url: str, model: str, max_tokens: int = 128, lookup: int = 5, clients_levels=(1, 4, 16)) -> list[dict]:
    """Output tokens/s on :data:`EDITS` with and without prompt-lookup speculation
    (``prompt_lookup_num_tokens``, greedy), at each number of clients, and whether the answers
    are the same texts."""
    rows = []
    for clients in clients_levels:
        prompts = [EDITS[i % len(EDITS)] for i in range(2 * clients)]
        plain = asyncio.run(_load(url, model, prompts, clients, max_tokens))
        drafted = asyncio.run(_load(url, model, prompts, clients, max_tokens, {"prompt_lookup_num_tokens": lookup}))
        rows.append({"clients": clients, "plain": plain["tokens_per_s"], "speculative": drafted["tokens_per_s"],
                     "speedup": drafted["tokens_per_s"] / plain["tokens_per_s"],
                     "same_texts": drafted["texts"] == plain["texts"]})
    return rows


async def _logprobs(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int):
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "logprobs": True, "top_logprobs": 1}
    r = await client.post(url + "/v1/chat/completions", json=body)
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]!r}")
    content = r.json()["choices"][0]["logprobs"]["content"]
    return [c["token"] for c in content], [c["logprob"] for c in content]


def invariance(url: str, model: str, max_tokens: int, trials: int = 3) -> dict:
    """A greedy request's tokens and logprobs alone and among 15 other requests sent at once."""
    async def run():
        limits = httpx.Limits(max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            alone = await _logprobs(client, url, model, PROMPTS[0], max_tokens)
            same_tokens, identical, largest = True, True, 0.0
            for trial in range(trials):
                others = [MIX[(1 + trial + i) % len(MIX)] for i in range(15)]
                together = await asyncio.gather(*(_logprobs(client, url, model, p, max_tokens)
                                                  for p in [*others[:7 + trial], PROMPTS[0], *others[7 + trial:]]))
                tokens, logprobs = together[7 + trial]
                same_tokens &= tokens == alone[0]
                identical &= tokens == alone[0] and logprobs == alone[1]
                largest = max([largest, *(abs(a - b) for a, b in zip(logprobs, alone[1]))])
            return {"same_tokens": same_tokens, "bit_identical": identical, "largest_logprob_difference": largest}
    return asyncio.run(run())


def _peer_available() -> bool:
    if not PEERS_PYTHON.is_file():
        return False
    return subprocess.run([str(PEERS_PYTHON), "-c", "import llama_cpp.server.app"], capture_output=True).returncode == 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serve", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="what scripts/serve.py serves")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2,
                   help="times each client level sends the whole prompt set (2: clients that finish ask again, so "
                        "requests join a running batch)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--serve-args", default="", help="more flags for scripts/serve.py, e.g. '--quantize gguf'")
    p.add_argument("--peer", choices=["auto", "yes", "no"], default="auto",
                   help="llama-cpp-python's server on the same GGUF file (auto: when `make bench-peers` built it)")
    p.add_argument("--llama-server", choices=["auto", "yes", "no"], default="auto",
                   help="also measure llama.cpp's llama-server (--parallel N) from `make llama-tools` (auto: if built)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    p.add_argument("--speculation-only", action="store_true",
                   help="only the copy-heavy table, ours with and without prompt-lookup drafts (no peers)")
    args = p.parse_args(argv)
    if 1 not in args.concurrency:
        p.error("--concurrency must include 1: the other levels are measured against it")

    results, checks = {}, {}
    port = _free_port()
    # the same room for computed prompts as llama-server's context (--parallel N -c N*1024, below)
    serve = [sys.executable, "scripts/serve.py", "--model", args.model, "--port", str(port), "--threads",
             str(args.threads), "--max-batch-size", str(max(args.concurrency)), "--log-level", "warning",
             "--prefix-cache-tokens", str(max(args.concurrency) * 1024), *args.serve_args.split()]
    name = ours = "llm" + (f" ({args.serve_args})" if args.serve_args else "")
    print(f"{name}: starting", file=sys.stderr, flush=True)
    server = ServerProcess(serve, port, "/health")
    try:
        if not args.speculation_only:
            results[name] = measure(server.url, args.model, concurrency=tuple(args.concurrency),
                                    max_tokens=args.max_tokens, rounds=args.rounds)
            checks[name] = invariance(server.url, args.model, args.max_tokens)
        drafts = speculation(server.url, args.model)
    finally:
        server.stop()
    if args.speculation_only:
        args.peer = args.llama_server = "no"

    if args.peer == "yes" or (args.peer == "auto" and _peer_available()):
        port = _free_port()
        gguf = registered_path(args.model) if not str(args.model).endswith(".gguf") else Path(args.model)
        peer = [str(PEERS_PYTHON), "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", args.model,
                "--n_threads", str(args.threads), "--n_ctx", "4096",
                # its default lets a new request cut off the one streaming: it serves one at a time
                "--interrupt_requests", "False", "--host", "127.0.0.1", "--port", str(port)]
        print("llama-cpp-python: starting", file=sys.stderr, flush=True)
        server = ServerProcess(peer, port, "/v1/models")
        try:
            results["llama-cpp-python"] = measure(server.url, args.model, concurrency=tuple(args.concurrency),
                                                  max_tokens=args.max_tokens, rounds=args.rounds)
        finally:
            server.stop()

    if args.llama_server == "yes" or (args.llama_server == "auto" and LLAMA_SERVER.is_file()):
        port = _free_port()
        gguf = registered_path(args.model) if not str(args.model).endswith(".gguf") else Path(args.model)
        slots = max(args.concurrency)
        # continuous batching over `slots` sequences; the context is shared among them
        peer = [str(LLAMA_SERVER), "-m", str(gguf), "--alias", args.model, "-t", str(args.threads),
                "--parallel", str(slots), "-c", str(slots * 1024), "--host", "127.0.0.1", "--port", str(port)]
        print("llama-server: starting", file=sys.stderr, flush=True)
        server = ServerProcess(peer, port, "/health")
        try:
            results["llama-server"] = measure(server.url, args.model, concurrency=tuple(args.concurrency),
                                              max_tokens=args.max_tokens, rounds=args.rounds)
            checks["llama-server"] = invariance(server.url, args.model, args.max_tokens)
        finally:
            server.stop()

    if results:
        print(table(results))
    if checks:
        print("\n| server | a greedy request among 15 others: same tokens | bit-identical logprobs | largest difference |")
        print("|---|---|---|---|")
    for name, c in checks.items():
        print(f"| {name} | {'yes' if c['same_tokens'] else 'no'} | {'yes' if c['bit_identical'] else 'no'} | "
              f"{c['largest_logprob_difference']:.2g} |")
    print(f"\n{ours}, copy-heavy requests (EDITS: a ~300-token passage repeated with an edit), greedy, 128 new "
          f"tokens at most:\n")
    print("| clients | output tokens/s | with prompt-lookup drafts (5 tokens) | speed-up | same answers |")
    print("|---|---|---|---|---|")
    for r in drafts:
        print(f"| {r['clients']} | {r['plain']:.1f} | {r['speculative']:.1f} | {r['speedup']:.2f}x | "
              f"{'yes' if r['same_texts'] else 'no'} |")
    if args.json:
        args.json.write_text(json.dumps({"load": results, "invariance": checks, "speculation": drafts}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
