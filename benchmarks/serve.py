"""Load on an OpenAI-compatible server: 1, 4 and 16 concurrent clients on a fixed set of chat prompts.

Starts ``scripts/serve.py`` (and, when the peers' environment of ``make bench-peers`` exists,
``llama-cpp-python``'s OpenAI server and llama.cpp's own ``llama-server`` with ``--parallel N``
continuous batching, on the same GGUF file), sends every prompt through
``/v1/chat/completions`` with ``stream: true`` (greedy, so every run decodes the same tokens), and
prints per server and concurrency: aggregate output tokens/s, time to first token p50/p95 and
request latency p50/p95, and the throughput against the same requests sent one after another.
The servers take turns (one runs while the other is stopped), so each has the machine alone.
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


async def _one(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, tokens, pieces = None, None, 0
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
                    pieces += 1
                    if first is None:
                        first = time.perf_counter() - start
    latency = time.perf_counter() - start
    return {"ttft": first if first is not None else latency, "latency": latency,
            "tokens": tokens if tokens is not None else pieces}


async def _load(url: str, model: str, prompts: list[str], clients: int, max_tokens: int) -> dict:
    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results = []

    async def client_loop(client):
        while not queue.empty():
            results.append(await _one(client, url, model, queue.get_nowait(), max_tokens))

    start = time.perf_counter()
    # a connection per request: llama-server closes idle keep-alive connections, which a reused one
    # would meet as "Server disconnected" (on localhost a new connection costs well under a millisecond)
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
    wall = time.perf_counter() - start
    ttft = [r["ttft"] for r in results]
    latency = [r["latency"] for r in results]
    tokens = sum(r["tokens"] for r in results)
    return {"clients": clients, "requests": len(results), "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "ttft_p50": _percentile(ttft, 50), "ttft_p95": _percentile(ttft, 95),
            "latency_p50": _percentile(latency, 50), "latency_p95": _percentile(latency, 95)}


def measure(url: str, model: str, *, concurrency: tuple[int, ...], max_tokens: int, rounds: int) -> list[dict]:
    """Every concurrency level over the prompts (``rounds`` times each), after one warm-up request."""
    asyncio.run(_load(url, model, PROMPTS[:1], 1, 8))
    rows = []
    for clients in concurrency:
        rows.append(asyncio.run(_load(url, model, PROMPTS * rounds, clients, max_tokens)))
        print(f"  {clients:>2} clients: {rows[-1]['tokens_per_s']:.1f} tokens/s", file=sys.stderr, flush=True)
    sequential = next(r for r in rows if r["clients"] == 1)["tokens_per_s"]
    for row in rows:
        row["vs_sequential"] = row["tokens_per_s"] / sequential
    return rows


def table(results: dict[str, list[dict]]) -> str:
    lines = ["| server | clients | output tokens/s | vs one after another | TTFT p50 / p95 (s) | "
             "latency p50 / p95 (s) |", "|---|---|---|---|---|---|"]
    for name, rows in results.items():
        for r in rows:
            lines.append(f"| {name} | {r['clients']} | {r['tokens_per_s']:.1f} | {r['vs_sequential']:.2f}x | "
                         f"{r['ttft_p50']:.2f} / {r['ttft_p95']:.2f} | {r['latency_p50']:.2f} / "
                         f"{r['latency_p95']:.2f} |")
    return "\n".join(lines)


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
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--serve-args", default="", help="more flags for scripts/serve.py, e.g. '--quantize gguf'")
    p.add_argument("--peer", choices=["auto", "yes", "no"], default="auto",
                   help="llama-cpp-python's server on the same GGUF file (auto: when `make bench-peers` built it)")
    p.add_argument("--llama-server", choices=["auto", "yes", "no"], default="auto",
                   help="also measure llama.cpp's llama-server (--parallel N) from `make llama-tools` (auto: if built)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    if 1 not in args.concurrency:
        p.error("--concurrency must include 1: the other levels are measured against it")

    results = {}
    port = _free_port()
    serve = [sys.executable, "scripts/serve.py", "--model", args.model, "--port", str(port), "--threads",
             str(args.threads), "--max-batch-size", str(max(args.concurrency)), "--log-level", "warning",
             *args.serve_args.split()]
    name = "llm" + (f" ({args.serve_args})" if args.serve_args else "")
    print(f"{name}: starting", file=sys.stderr, flush=True)
    server = ServerProcess(serve, port, "/health")
    try:
        results[name] = measure(server.url, args.model, concurrency=tuple(args.concurrency),
                                max_tokens=args.max_tokens, rounds=args.rounds)
    finally:
        server.stop()

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
        finally:
            server.stop()

    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
