"""llama.cpp as a benchmark peer: the same GGUF file, prompt token ids, thread count and new tokens.

:class:`LlamaCpp` drives llama.cpp through llama-cpp-python's low-level bindings of ``llama.h``
(``llama_decode`` over a ``llama_batch``, as llama.cpp's own ``examples/batched`` does), so that
it is fed token ids rather than text, decodes greedily without stopping early, runs several
sequences in one batch, and hands back its logits for scoring. llama-cpp-python lives in a
virtual environment of its own (``make bench-peers``), never in the main one.

This module imports neither torch nor ``llm``: run as a script (``python -P peers.py run ...``)
it is a process holding llama.cpp alone, whose peak RSS and speed the benchmark measures as
llama.cpp's own (:func:`run_alone`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

INSTALL_HINT = "llama-cpp-python is not importable here: run `make bench-peers` (it builds .venv-peers)"


def llama_cpp_missing() -> str | None:
    """None when ``llama_cpp`` imports, else why not, with how to get it."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as e:
        return f"{INSTALL_HINT} ({e})"
    return None


class LlamaCpp:
    """A GGUF model in llama.cpp, CPU only, fed token ids.

    Args:
        path: the ``.gguf`` file.
        n_threads: threads for decoding and for prompt batches (the benchmark passes torch's count).
        n_ctx: KV cache positions over all sequences (llama.cpp gives each of ``n_seq_max``
            sequences ``n_ctx / n_seq_max``).
        n_seq_max: sequences decoded side by side (the batch size).
        n_batch: tokens per ``llama_decode`` call; longer inputs are split.
        use_extra_bufts: let llama.cpp repack weights into its extra CPU buffer types (AMX and
            the repacked Q4 layouts); False where AMX tiles are unusable (see :func:`extra_bufts_usable`).

    Raises:
        ImportError: without llama-cpp-python (``make bench-peers``).
        ValueError: if llama.cpp cannot load the file or make a context for it.
    """

    def __init__(self, path: str | os.PathLike, *, n_threads: int, n_ctx: int = 2048, n_seq_max: int = 1,
                 n_batch: int = 512, use_extra_bufts: bool = True):
        import llama_cpp
        from llama_cpp import _logger

        _logger.set_verbose(False)
        self._lib = llama_cpp
        start = time.perf_counter()
        model_params = llama_cpp.llama_model_default_params()
        model_params.use_extra_bufts = use_extra_bufts
        self._model = llama_cpp.llama_model_load_from_file(str(path).encode(), model_params)
        if not self._model:
            raise ValueError(f"llama.cpp could not load {path}")
        context_params = llama_cpp.llama_context_default_params()
        context_params.n_ctx = n_ctx
        context_params.n_batch = context_params.n_ubatch = n_batch
        context_params.n_seq_max = n_seq_max
        context_params.n_threads = context_params.n_threads_batch = n_threads
        context_params.no_perf = True
        self._ctx = llama_cpp.llama_init_from_model(self._model, context_params)
        if not self._ctx:
            llama_cpp.llama_model_free(self._model)
            raise ValueError(f"llama.cpp could not make a context of {n_ctx} positions for {path}")
        self.load_seconds = time.perf_counter() - start
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self._model))
        self.n_batch, self.n_seq_max = n_batch, n_seq_max
        self._batch = llama_cpp.llama_batch_init(n_batch, 0, 1)

    def close(self) -> None:
        """Free llama.cpp's batch, context and model (idempotent)."""
        if self._ctx:
            self._lib.llama_batch_free(self._batch)
            self._lib.llama_free(self._ctx)
            self._lib.llama_model_free(self._model)
            self._ctx = self._model = None

    def reset(self) -> None:
        """Empty the KV cache of every sequence."""
        self._lib.llama_memory_clear(self._lib.llama_get_memory(self._ctx), True)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> list[np.ndarray]:
        """One ``llama_decode`` of (token, position, sequence, wants logits) entries, at most
        ``n_batch``; returns the requested logits rows, (n_vocab,) float32 each, in order."""
        batch = self._batch
        for i, (token, pos, seq, wants) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, wants
        batch.n_tokens = len(entries)
        rc = self._lib.llama_decode(self._ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} for {len(entries)} tokens (KV cache full?)")
        return [np.ctypeslib.as_array(self._lib.llama_get_logits_ith(self._ctx, i), shape=(self.n_vocab,))
                for i, e in enumerate(entries) if e[3]]

    def _run(self, entries: list[tuple[int, int, int, bool]]) -> list[np.ndarray]:
        rows = []
        for start in range(0, len(entries), self.n_batch):
            rows += [row.copy() for row in self._decode(entries[start:start + self.n_batch])]
        return rows

    def logits(self, ids: list[int]) -> np.ndarray:
        """(len(ids), n_vocab) float32 logits of the next token at every position of one
        sequence, from an empty cache."""
        self.reset()
        return np.stack(self._run([(t, p, 0, True) for p, t in enumerate(ids)]))

    def greedy(self, prompts: list[list[int]], new_tokens: int, on_token=None) -> np.ndarray:
        """Greedy decoding of ``len(prompts)`` sequences side by side (each its own KV sequence),
        ``new_tokens`` each, never stopping early. Returns (batch, new_tokens) int64 new token ids.
        ``on_token``, if given, is called with each step's (batch,) int64 ids as soon as they are
        chosen (e.g. ``TokenClock.tick`` of :mod:`benchmarks.generate`).

        Raises:
            ValueError: for more prompts than ``n_seq_max`` or an empty prompt.
        """
        if not 0 < len(prompts) <= self.n_seq_max or not all(prompts):
            raise ValueError(f"greedy takes 1 to {self.n_seq_max} non-empty prompts, got {len(prompts)}")
        self.reset()
        prefill = [(t, p, s, p == len(ids) - 1) for s, ids in enumerate(prompts) for p, t in enumerate(ids)]
        out = np.empty((len(prompts), new_tokens), dtype=np.int64)
        rows = self._run(prefill)
        for step in range(new_tokens):
            out[:, step] = [int(row.argmax()) for row in rows]
            if on_token is not None:
                on_token(out[:, step])
            if step + 1 < new_tokens:
                rows = self._decode([(int(out[s, step]), len(ids) + step, s, True) for s, ids in enumerate(prompts)])
        return out


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_alone(path: str | os.PathLike, prompt: list[int], new_tokens: int, *, n_threads: int,
              use_extra_bufts: bool = True, python: str | None = None, timeout: float = 600.0) -> dict:
    """Load ``path`` in llama.cpp in a process of its own (this file as a script, without torch),
    decode ``new_tokens`` greedily after ``prompt`` at batch 1, and measure that process.

    Returns:
        ``load_s``, ``ttft_s`` (prefill and first token, best of 3), ``decode_tokens_per_s``
        (new tokens after the first, per second from the first to the last, median of 3),
        ``tokens`` (the new ids) and ``peak_rss_mb`` (the child's ``ru_maxrss``).

    Raises:
        RuntimeError: if the child fails; its exit status and stderr tail are in the message
            (a status of -4 is SIGILL: see :func:`extra_bufts_usable`).
    """
    argv = [python or sys.executable, "-P", __file__, "run", str(path), "--prompt", ",".join(map(str, prompt)),
            "--new-tokens", str(new_tokens), "--threads", str(n_threads), "--extra-bufts", str(int(use_extra_bufts))]
    status, out, err, rss_kb = child_peak_rss(argv, timeout)
    if status != 0:
        raise RuntimeError(f"llama.cpp child exited with {status}: {err[-800:]}")
    return {**json.loads(out), "peak_rss_mb": rss_kb / 1024}


def child_peak_rss(argv: list[str], timeout: float | None = None,
                   env: dict[str, str] | None = None) -> tuple[int, str, str, int]:
    """Run ``argv`` (in ``env``, default this process's environment) and wait for it with
    ``os.wait4``, which gives that child's own resource use.

    Returns:
        (exit status: negative for a signal, as ``subprocess``; stdout; stderr; peak resident
        set size in KiB, ``ru_maxrss`` of the child alone).

    Raises:
        subprocess.TimeoutExpired: if it runs past ``timeout`` seconds (it is killed).
    """
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if deadline is not None and time.monotonic() > deadline:
                proc.kill()
                os.wait4(proc.pid, 0)
                proc.returncode = -signal.SIGKILL
                raise subprocess.TimeoutExpired(argv, timeout)
            time.sleep(0.01)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        return proc.returncode, out.read().decode(), err.read().decode(errors="replace"), usage.ru_maxrss


def extra_bufts_usable(path: str | os.PathLike, *, n_threads: int, python: str | None = None) -> bool:
    """Whether llama.cpp survives its extra CPU buffer types here: on a Xeon VM that reports AMX
    but whose AMX tiles are unusable, the repacked AMX weights die with SIGILL. Probed in a
    child process (load and decode a few tokens), so the caller lives either way.

    Raises:
        RuntimeError: if the probe fails for another reason than SIGILL.
    """
    try:
        run_alone(path, [1, 2, 3, 4], 2, n_threads=n_threads, python=python, timeout=300)
    except RuntimeError as e:
        if f"exited with {-signal.SIGILL}:" in str(e):
            return False
        raise
    return True


def main(argv: list[str] | None = None) -> int:
    """``run``: the child of :func:`run_alone`; prints its figures as one JSON line."""
    p = argparse.ArgumentParser(prog="peers.py", description="llama.cpp alone in this process (a benchmark child)")
    p.add_argument("command", choices=["run"])
    p.add_argument("gguf")
    p.add_argument("--prompt", required=True, help="comma-separated prompt token ids")
    p.add_argument("--new-tokens", type=int, required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--extra-bufts", type=int, choices=[0, 1], default=1)
    args = p.parse_args(argv)
    prompt = [int(t) for t in args.prompt.split(",")]
    llama = LlamaCpp(args.gguf, n_threads=args.threads, n_ctx=len(prompt) + args.new_tokens + 16,
                     use_extra_bufts=bool(args.extra_bufts))
    tokens = llama.greedy([prompt], args.new_tokens)
    ttft = min(_timed(lambda: llama.greedy([prompt], 1)) for _ in range(3))
    rates = []
    for _ in range(3):
        times = []
        llama.greedy([prompt], args.new_tokens, on_token=lambda ids: times.append(time.perf_counter()))
        rates.append((args.new_tokens - 1) / max(times[-1] - times[0], 1e-9))
    print(json.dumps({"load_s": llama.load_seconds, "ttft_s": ttft, "tokens": tokens[0].tolist(),
                      "decode_tokens_per_s": statistics.median(rates)}))
    llama.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
