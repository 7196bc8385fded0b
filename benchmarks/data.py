"""Benchmark of the data pipeline: preparation throughput and memory, and loader throughput.

:func:`run` (``python -m benchmarks.data``) measures, in one run:

1. **Prepare throughput**: ``scripts/prepare_data.py`` (the real code path, default options,
   ``--workers`` = all CPUs) over a generated JSON Lines corpus of ``size_mb`` MB of real text
   (the training plays cut into documents and the English documents of ``data/english``, grouped
   into documents of 1-8 KB, shuffled with a seed and repeated with variation), end to end (from
   the command's start to its exit: Python start-up, tokenizer loading and index writing included),
   against the raw throughput of ``tokenizers``' ``Tokenizer.encode_batch_fast`` over the same
   text read from the same files (``json.loads`` of each line), in batches of the preparer's size,
   on as many Rust threads (``RAYON_NUM_THREADS``), in a bare process of its own: half the files
   before preparing and half after, so that a change of load on the machine weighs on both.
   Goal: prepare >= 70% of raw.
2. **Peak RSS of prepare**: the preparing process's peak (``VmHWM``, sampled; with no other
   process in its tree, ``wait4``'s ``ru_maxrss``, which also covers the interpreter's exit), each
   descendant process's peak (summed: forked workers share pages, so the sum over-counts) and the
   largest sampled sum of the tree's RSS. Goal: main peak + workers' peaks < 1 GB (10**9 bytes).
3. **Loader throughput**: :func:`llm.data.streaming.build_token_dataset` over the prepared train
   split as the default config reads it (shuffle on, max_seq_len 128, device batch 32, a torch
   ``DataLoader`` with ``num_workers`` 0), in tokens/s, against the tokens/s a training step of the
   default model (``configs/shakespeare.yaml``: forward + backward over two microbatches of 16,
   gradient clipping, ``DecoupledAdamW``; fp32) consumes on this machine. Goal: loader >= 20x.
   For comparison, shuffled samples read straight from the same dataset (``dataset[i]``, without
   Streaming's iteration threads, which poll and contend for the GIL) are timed too.

The machine is shared: the load average before and after is recorded, as other work on the CPUs
slows every figure. Work goes to a temporary folder (``--work-dir``), removed at the end unless
``--keep``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

# Relative to the current directory: the benchmark runs from the checkout's root (`make data` fetched these).
PLAYS_TEXT = Path("data/shakespeare/text/train")
ENGLISH = Path("data/english")
DEFAULT_TOKENIZER = Path("data/shakespeare/bpe-2048/tokenizer")
DEFAULT_CONFIG = Path("configs/shakespeare.yaml")
PREPARE_SCRIPT = Path("scripts/prepare_data.py")
MB = 1_000_000  # sizes, rates and memory in MB are 10**6 bytes
GOAL_PREPARE_RATIO = 0.70
GOAL_PEAK_RSS = 1000 * MB  # 1 GB
GOAL_LOADER_RATIO = 20.0
#: Documents are made of whole source documents or paragraphs, grouped to a size drawn from this range.
DOC_BYTES = (1_000, 8_000)
FILE_BYTES = 64 * MB  # corpus bytes per .jsonl file (fewer for small corpora)


def cpu_model() -> str:
    """The CPU's model name (``lscpu``), with the number of CPUs this process may use."""
    name = None
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        name = next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), None)
    except (OSError, subprocess.CalledProcessError):
        pass
    if name is None:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    return f"{name}, {cpu_count()} CPUs"


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


# ---------------------------------------------------------------------------------------------
# The corpus


def _group(units: Iterator[str], rng: random.Random, sep: str) -> Iterator[str]:
    """Consecutive ``units`` joined by ``sep`` into documents of a size drawn from DOC_BYTES."""
    parts, size, target = [], 0, rng.randint(*DOC_BYTES)
    for unit in units:
        if not unit.strip():
            continue
        parts.append(unit)
        size += len(unit) + len(sep)
        if size >= target:
            yield sep.join(parts)
            parts, size, target = [], 0, rng.randint(*DOC_BYTES)
    if parts:
        yield sep.join(parts)


@functools.lru_cache(maxsize=2)
def source_documents(seed: int = 0) -> tuple[str, ...]:
    """The real documents the corpus is made of: the training plays cut at blank lines into
    documents of 1-8 KB, and the English documents (``data/english/*/documents.jsonl``, field
    ``text``) with consecutive small ones grouped to 1-8 KB (larger ones kept whole).

    Raises FileNotFoundError if neither is present (run ``make data``)."""
    rng = random.Random(seed)
    docs = []
    for path in sorted(PLAYS_TEXT.glob("*.txt")):
        docs += _group(iter(path.read_text(encoding="utf-8").split("\n\n")), rng, "\n\n")
    for path in sorted(ENGLISH.glob("*/documents.jsonl")):
        with open(path, encoding="utf-8") as f:
            docs += _group((json.loads(line)["text"] for line in f if line.strip()), rng, "\n\n")
    if not docs:
        raise FileNotFoundError(f"no text under {PLAYS_TEXT} or {ENGLISH}: run `make data` first")
    return tuple(docs)


def _vary(text: str, rng: random.Random) -> str:
    """The text with its lines (or, for a single line, its sentences) rotated by a random count."""
    sep = "\n" if "\n" in text else ". "
    parts = text.split(sep)
    k = rng.randrange(len(parts))
    return sep.join(parts[k:] + parts[:k])


@dataclass
class Corpus:
    folder: Path
    files: list[Path]
    documents: int
    bytes: int  # UTF-8 bytes of the texts (what prepare counts), not of the JSON


def write_corpus(folder: str | os.PathLike, size_bytes: int, seed: int = 0) -> Corpus:
    """Write at least ``size_bytes`` of text as JSON Lines files (``{"text": ...}`` per line) in
    ``folder``: the source documents shuffled, the first pass as they are and each later pass
    shuffled again with each document varied (:func:`_vary`), until the size is reached."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    pool = source_documents(seed)
    rng = random.Random(seed)
    file_bytes = max(MB, min(FILE_BYTES, size_bytes // 8))
    files, written, documents, f, in_file, passes = [], 0, 0, None, 0, 0
    try:
        while written < size_bytes:
            order = list(range(len(pool)))
            rng.shuffle(order)
            for i in order:
                text = pool[i] if passes == 0 else _vary(pool[i], rng)
                if f is None or in_file >= file_bytes:
                    if f is not None:
                        f.close()
                    files.append(folder / f"part-{len(files):05d}.jsonl")
                    f, in_file = open(files[-1], "w", encoding="utf-8"), 0
                f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
                n = len(text.encode("utf-8"))
                written, in_file, documents = written + n, in_file + n, documents + 1
                if written >= size_bytes:
                    break
            passes += 1
    finally:
        if f is not None:
            f.close()
    return Corpus(folder, files, documents, written)


# ---------------------------------------------------------------------------------------------
# Raw tokenizers throughput


def raw_encode(files: Sequence[str | os.PathLike], tokenizer_file: str, batch_bytes: int) -> dict:
    """Encode the ``text`` of every JSON Lines record of ``files`` with ``encode_batch_fast`` in
    batches of about ``batch_bytes`` characters: ``{"documents", "tokens", "seconds"}``.

    Rust's thread count is the process's (``RAYON_NUM_THREADS``; ``TOKENIZERS_PARALLELISM`` on):
    run it in a process of its own (:func:`measure_raw`)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(tokenizer_file)
    start = time.perf_counter()
    documents = tokens = 0
    batch, size = [], 0
    for path in files:
        with open(path, encoding="utf-8") as f:
            for line in f:
                text = json.loads(line)["text"]
                batch.append(text)
                size += len(text)
                if size >= batch_bytes:
                    tokens += sum(map(len, tokenizer.encode_batch_fast(batch, add_special_tokens=False)))
                    documents += len(batch)
                    batch, size = [], 0
    if batch:
        tokens += sum(map(len, tokenizer.encode_batch_fast(batch, add_special_tokens=False)))
        documents += len(batch)
    return {"documents": documents, "tokens": tokens, "seconds": time.perf_counter() - start}


def backend_tokenizer_file(spec: str, path: Path) -> Path:
    """Write the backend ``tokenizer.json`` that preparation encodes with (no padding or truncation)."""
    from tokenizers import Tokenizer

    from llm.data.tokenizer import load_tokenizer

    backend = Tokenizer.from_str(load_tokenizer(spec).backend_tokenizer.to_str())
    backend.no_padding()
    backend.no_truncation()
    backend.save(str(path))
    return path


def measure_raw(files: Sequence[Path], tokenizer_file: Path, threads: int, batch_bytes: int) -> dict:
    """:func:`raw_encode` of ``files`` in a fresh process with ``threads`` Rust threads, plus the
    process's ``cpu_seconds`` (user + system, start-up included)."""
    env = {**os.environ, "RAYON_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "true"}
    # The function's own source in a bare interpreter: importing this module would import `llm`,
    # and with it torch (seconds of start-up, hundreds of MB).
    code = ("from __future__ import annotations\nimport json, sys, time\n" + inspect.getsource(raw_encode)
            + "\nprint(json.dumps(raw_encode(*json.loads(sys.argv[1]))))\n")
    args = json.dumps([[str(p) for p in files], str(tokenizer_file), batch_bytes])
    child = run_child([sys.executable, "-c", code, args], env=env)
    result = json.loads(child["stdout"].strip().splitlines()[-1])
    result["cpu_seconds"] = child["cpu_seconds"]
    return result


def combine_raw(parts: Sequence[dict], corpus: Corpus, threads: int) -> dict:
    """The raw figures of the whole corpus from those of its parts."""
    total = {key: sum(part[key] for part in parts) for key in ("documents", "tokens", "seconds", "cpu_seconds")}
    return {**total, "parts": len(parts), "threads": threads, "mb_per_s": corpus.bytes / MB / total["seconds"]}


# ---------------------------------------------------------------------------------------------
# Prepare, timed and its memory watched


def _status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of ``pid`` in bytes (empty if it is gone)."""
    values = {}
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    values[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError):
        return {}
    return values


def _descendants(pid: int) -> list[int]:
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            parents.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


class MemoryWatch:
    """Samples a process tree every ``interval`` seconds in a thread: each process's last seen
    peak (VmHWM, the kernel's exact high-water mark) and the largest sum of RSS over the tree."""

    def __init__(self, pid: int, interval: float = 0.1):
        self.pid, self.interval = pid, interval
        self.peaks: dict[int, int] = {}
        self.tree_rss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "MemoryWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def sample(self) -> None:
        total = 0
        for pid in [self.pid] + (_descendants(self.pid) if os.path.exists("/proc") else []):
            status = _status(pid)
            if status:
                self.peaks[pid] = max(self.peaks.get(pid, 0), status.get("VmHWM", 0))
                total += status.get("VmRSS", 0)
        self.tree_rss = max(self.tree_rss, total)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)


def run_child(command: Sequence[str], *, env: dict | None = None, watch: bool = False) -> dict:
    """Run ``command`` in the current directory: its ``stdout``, ``seconds`` (wall), ``cpu_seconds`` (user +
    system, its waited descendants included) and ``ru_maxrss`` (bytes) from ``wait4``, and with
    ``watch`` its process tree's memory (a :class:`MemoryWatch`). Raises RuntimeError if it fails."""
    start = time.perf_counter()
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    memory = MemoryWatch(process.pid)
    with memory if watch else contextlib.nullcontext():
        # Read the pipes in threads so a chatty child never blocks; wait4 gives its rusage.
        pipes: dict[str, bytes] = {}
        readers = [threading.Thread(target=lambda name=name, pipe=pipe: pipes.__setitem__(name, pipe.read()))
                   for name, pipe in (("stdout", process.stdout), ("stderr", process.stderr))]
        for reader in readers:
            reader.start()
        _, status, usage = os.wait4(process.pid, 0)
        seconds = time.perf_counter() - start
        process.returncode = os.waitstatus_to_exitcode(status)
        for reader in readers:
            reader.join()
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command)[:300]} failed ({process.returncode}):\n{pipes['stderr'].decode()}")
    return {"stdout": pipes["stdout"].decode(), "seconds": seconds, "cpu_seconds": usage.ru_utime + usage.ru_stime,
            "ru_maxrss": usage.ru_maxrss * 1024, "memory": memory if watch else None, "pid": process.pid}


def measure_prepare(corpus: Corpus, out: Path, tokenizer: str, workers: int) -> dict:
    """Run ``scripts/prepare_data.py`` on the corpus (default options, ``--workers``, ``--quiet``)
    in its own process: wall time, MB/s, the manifest's counts and the processes' peak RSS."""
    command = [sys.executable, str(PREPARE_SCRIPT), str(corpus.folder), "--out", str(out), "--tokenizer", tokenizer,
               "--workers", str(workers), "--quiet", "--overwrite"]
    child = run_child(command, watch=True)
    seconds, watch = child["seconds"], child["memory"]
    manifest = json.loads((out / "llm_data.json").read_text())
    splits = manifest["splits"].values()
    total = {key: sum(s[key] for s in splits) for key in ("documents", "tokens", "bytes", "rows", "dropped_tokens")}
    workers_peaks = [peak for pid, peak in watch.peaks.items() if pid != child["pid"]]
    # Without other processes, wait4's figure is the main process's own peak, exit included.
    main_peak = max(watch.peaks.get(child["pid"], 0), 0 if workers_peaks else child["ru_maxrss"])
    return {
        "command": " ".join(command), "seconds": seconds, "mb_per_s": total["bytes"] / MB / seconds,
        "split_seconds": sum(s["seconds"] for s in splits),
        "split_mb_per_s": total["bytes"] / MB / sum(s["seconds"] for s in splits),
        **total, "splits": manifest["splits"], "dtype": manifest["dtype"], "seq_len": manifest["seq_len"],
        "vocab_size": manifest["tokenizer"]["vocab_size"],
        "peak_rss_main": main_peak, "worker_processes": len(workers_peaks),
        "peak_rss_workers_sum": sum(workers_peaks), "peak_rss_total": main_peak + sum(workers_peaks),
        "peak_tree_rss_sampled": watch.tree_rss, "ru_maxrss": child["ru_maxrss"], "cpu_seconds": child["cpu_seconds"],
    }


# ---------------------------------------------------------------------------------------------
# Loader and training step


def model_settings(config: Path) -> dict:
    """The model section and the batch / optimizer settings of a training config."""
    import yaml

    cfg = yaml.safe_load(config.read_text(encoding="utf-8"))
    optimizer = {k: v for k, v in (cfg.get("optimizer") or {}).items() if k != "name"}
    clipping = ((cfg.get("algorithms") or {}).get("gradient_clipping") or {}).get("clipping_threshold")
    return {"model": cfg["model"], "batch": cfg.get("global_train_batch_size", 32),
            "microbatch": cfg.get("device_train_microbatch_size", 16), "optimizer": optimizer,
            "clipping": clipping, "seed": cfg.get("seed", 17), "precision": cfg.get("precision", "fp32"),
            "shuffle": cfg["train_loader"]["dataset"].get("shuffle", True)}


def measure_loader(prepared: Path, *, max_seq_len: int, batch: int, seed: int, shuffle: bool = True,
                   seconds: float = 5.0, max_batches: int = 20000) -> tuple[dict, list]:
    """Iterate the train split as the training run does (tokens/s after the first batch), then read
    shuffled samples straight from the dataset (``dataset[i]``, batched by ``default_collate``):
    the cost of the data itself, without Streaming's iteration threads. Returns the figures and a
    few batches (for the training step)."""
    import torch
    from torch.utils.data import DataLoader, default_collate

    from llm.data.streaming import build_token_dataset, resolve_sources

    torch.manual_seed(seed)
    start = time.perf_counter()
    sources = resolve_sources({"local": str(prepared), "split": "train"}, "train")
    dataset = build_token_dataset(sources, {"shuffle": shuffle}, max_seq_len=max_seq_len,
                                  device_batch_size=batch, seed=seed)
    loader = DataLoader(dataset, batch_size=batch, drop_last=True, num_workers=0)
    iterator = iter(loader)
    kept = [next(iterator)]
    first = time.perf_counter() - start
    count, tokens, t0 = 0, 0, time.perf_counter()
    for item in iterator:
        count += 1
        tokens += item["input_ids"].numel()
        if len(kept) < 8:
            kept.append(item)
        if count >= max_batches or time.perf_counter() - t0 >= seconds:
            break
    elapsed = time.perf_counter() - t0
    # Stop the epoch's background threads (Streaming stops them only when a new epoch starts), so
    # that they take no CPU from what is measured next.
    if hasattr(dataset, "_iterator"):
        dataset._iterator.exit()
    del iterator, loader
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed)).tolist()
    direct, direct_tokens, t0 = 0, 0, time.perf_counter()
    for i in range(0, len(order) - batch + 1, batch):
        direct_tokens += default_collate([dataset[j] for j in order[i:i + batch]])["input_ids"].numel()
        direct += 1
        if direct >= max_batches or time.perf_counter() - t0 >= seconds / 2:
            break
    direct_seconds = time.perf_counter() - t0
    del dataset
    return {"first_batch_seconds": first, "batches": count, "seconds": elapsed, "tokens_per_s": tokens / elapsed,
            "direct_batches": direct, "direct_tokens_per_s": direct_tokens / direct_seconds}, kept


def measure_step(settings: dict, vocab_size: int, batches: list, *, steps: int = 5, warmup: int = 2) -> dict:
    """Tokens/s of training steps of the config's model on ``batches`` (cycled): per step, forward +
    backward over microbatches, gradient clipping and a ``DecoupledAdamW`` step, in the config's
    precision (``amp_bf16``: the forward under bf16 autocast, as training on a CPU runs it; else fp32)."""
    import dataclasses

    import torch
    from composer.optim import DecoupledAdamW

    from llm.config import MosaicGPTConfig
    from llm.train.composer_model import ComposerMosaicGPT

    torch.manual_seed(settings["seed"])
    fields = {f.name for f in dataclasses.fields(MosaicGPTConfig)}
    config = MosaicGPTConfig(**{k: v for k, v in settings["model"].items() if k in fields}, vocab_size=vocab_size)
    model = ComposerMosaicGPT(config)
    model.autocast_dtype = torch.bfloat16 if settings.get("precision") == "amp_bf16" else None
    model.train()
    optimizer = DecoupledAdamW(model.parameters(), **settings["optimizer"])
    micro = settings["microbatch"]
    times, tokens = [], 0
    for step in range(warmup + steps):
        batch = batches[step % len(batches)]
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        size = batch["input_ids"].shape[0]
        for i in range(0, size, micro):
            part = {k: v[i:i + micro] for k, v in batch.items()}
            loss = model.loss(model(part), part) * (part["input_ids"].shape[0] / size)
            loss.backward()
        if settings["clipping"]:
            torch.nn.utils.clip_grad_norm_(model.parameters(), settings["clipping"])
        optimizer.step()
        if step >= warmup:
            times.append(time.perf_counter() - start)
            tokens += batch["input_ids"].numel()
    return {"steps": steps, "seconds_per_step": sum(times) / len(times), "tokens_per_s": tokens / sum(times),
            "threads": torch.get_num_threads(), "batch": list(batches[0]["input_ids"].shape), "microbatch": micro,
            "precision": settings.get("precision", "fp32")}


# ---------------------------------------------------------------------------------------------
# The run


def _tokenizer_spec(given: str | None, corpus: Corpus, work: Path) -> str:
    if given:
        return given
    if (DEFAULT_TOKENIZER / "tokenizer.json").is_file():
        return str(DEFAULT_TOKENIZER)
    from llm.data.tokenizer import save_prepared_tokenizer, train_tokenizer

    def slice_texts(limit: int = 2 * MB) -> Iterator[str]:
        seen = 0
        with open(corpus.files[0], encoding="utf-8") as f:
            for line in f:
                text = json.loads(line)["text"]
                yield text
                seen += len(text)
                if seen >= limit:
                    return

    tokenizer = train_tokenizer("bpe:2048", slice_texts())
    save_prepared_tokenizer(tokenizer, work / "tokenizer", "bpe:2048")
    return str(work / "tokenizer")


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run(size_mb: float = 1024, workers: int | None = None, tokenizer: str | None = None, *,
        work_dir: str | os.PathLike | None = None, keep: bool = False, seed: int = 0,
        config: str | os.PathLike = DEFAULT_CONFIG, loader_seconds: float = 5.0, steps: int = 5,
        warmup: int = 2) -> dict:
    """Run the whole benchmark (see the module doc) and return its figures."""
    from llm.data.prepare import _BATCH_BYTES

    workers = workers or cpu_count()
    work = Path(tempfile.mkdtemp(prefix="bench-data-", dir=work_dir))
    figures: dict = {"cpu": cpu_model(), "workers": workers, "load_average_start": load_average(),
                     "python": sys.version.split()[0]}
    try:
        start = time.perf_counter()
        _log(f"writing a corpus of {size_mb:g} MB in {work / 'corpus'}")
        corpus = write_corpus(work / "corpus", int(size_mb * MB), seed)
        figures["corpus"] = {"files": len(corpus.files), "documents": corpus.documents, "bytes": corpus.bytes,
                             "seconds": time.perf_counter() - start}
        spec = _tokenizer_spec(tokenizer, corpus, work)
        figures["tokenizer"] = spec
        tokenizer_file = backend_tokenizer_file(spec, work / "backend-tokenizer.json")

        # Raw encoding of the first half of the files before preparing, of the rest after: a change
        # of load on the machine during the run weighs on both sides.
        half = (len(corpus.files) + 1) // 2
        _log(f"raw encode_batch_fast on {workers} threads, first {half} of {len(corpus.files)} files")
        raw = [measure_raw(corpus.files[:half], tokenizer_file, workers, _BATCH_BYTES)]
        _log(f"prepare with --workers {workers}")
        figures["prepare"] = measure_prepare(corpus, work / "prepared", spec, workers)
        _log(f"prepare: {figures['prepare']['mb_per_s']:.2f} MB/s; raw encoding of the other files")
        if corpus.files[half:]:
            raw.append(measure_raw(corpus.files[half:], tokenizer_file, workers, _BATCH_BYTES))
        figures["raw"] = combine_raw(raw, corpus, workers)
        figures["prepare_ratio"] = figures["prepare"]["mb_per_s"] / figures["raw"]["mb_per_s"]
        _log(f"raw: {figures['raw']['mb_per_s']:.2f} MB/s; loader")

        settings = model_settings(Path(config))
        max_seq_len, batch = settings["model"]["max_seq_len"], settings["batch"]
        figures["loader"], batches = measure_loader(work / "prepared", max_seq_len=max_seq_len, batch=batch,
                                                    seed=settings["seed"], shuffle=settings["shuffle"],
                                                    seconds=loader_seconds)
        _log(f"loader: {figures['loader']['tokens_per_s']:,.0f} tokens/s; training steps")
        figures["step"] = measure_step(settings, figures["prepare"]["vocab_size"], batches, steps=steps,
                                       warmup=warmup)
        figures["loader_ratio"] = figures["loader"]["tokens_per_s"] / figures["step"]["tokens_per_s"]
        figures["seconds"] = time.perf_counter() - start
        figures["load_average_end"] = load_average()
    finally:
        if keep:
            _log(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    figures["checks"] = checks(figures)
    return figures


def checks(figures: dict) -> dict:
    """Consistency of the figures: prepare saw every document and byte of the corpus, and its
    tokens are the raw encoding's plus one eos per document."""
    p, raw, corpus = figures["prepare"], figures["raw"], figures["corpus"]
    return {
        "documents": p["documents"] == raw["documents"] == corpus["documents"],
        "bytes": p["bytes"] == corpus["bytes"],
        "tokens": p["tokens"] == raw["tokens"] + raw["documents"],
        "rows": all(s["rows"] * p["seq_len"] + s["dropped_tokens"] == s["tokens"] for s in p["splits"].values()),
    }


def _verdict(ok: bool) -> str:
    return "pass" if ok else "FAIL"


def table(figures: dict) -> str:
    """The figures as a markdown table, with their goals, and notes."""
    p, raw, loader, step = figures["prepare"], figures["raw"], figures["loader"], figures["step"]
    c = figures["corpus"]

    def mb(n: float) -> str:
        return f"{n / MB:,.0f} MB"

    rows = [
        (f"Prepare throughput (`prepare_data.py --workers {figures['workers']}`, end to end)",
         f"{p['mb_per_s']:.2f} MB/s", "", ""),
        (f"Raw `encode_batch_fast` throughput (same files, {raw['threads']} Rust threads)",
         f"{raw['mb_per_s']:.2f} MB/s", "", ""),
        ("Prepare / raw", f"{figures['prepare_ratio']:.0%}", f">= {GOAL_PREPARE_RATIO:.0%}",
         _verdict(figures["prepare_ratio"] >= GOAL_PREPARE_RATIO)),
        ("Prepare peak RSS, main process", mb(p["peak_rss_main"]), "", ""),
        (f"Prepare peak RSS, worker processes ({p['worker_processes']}), sum of peaks",
         mb(p["peak_rss_workers_sum"]), "", ""),
        ("Prepare peak RSS, main + workers", mb(p["peak_rss_total"]), f"< {mb(GOAL_PEAK_RSS)}",
         _verdict(p["peak_rss_total"] < GOAL_PEAK_RSS)),
        (f"Loader (`build_token_dataset`, shuffle, {step['batch'][0]} x {step['batch'][1]} tokens, num_workers 0)",
         f"{loader['tokens_per_s']:,.0f} tokens/s", "", ""),
        (f"Training step, default model ({step['precision']}, microbatch {step['microbatch']}, {step['threads']} threads)",
         f"{step['tokens_per_s']:,.0f} tokens/s", "", ""),
        ("Loader / training step", f"{figures['loader_ratio']:,.0f}x", f">= {GOAL_LOADER_RATIO:.0f}x",
         _verdict(figures["loader_ratio"] >= GOAL_LOADER_RATIO)),
        ("Shuffled samples read straight from the dataset (`dataset[i]`, no iteration threads)",
         f"{loader['direct_tokens_per_s']:,.0f} tokens/s", "", ""),
    ]
    lines = [f"CPU: {figures['cpu']}; load average {figures['load_average_start']} at the start, "
             f"{figures.get('load_average_end', '-')} at the end (other work on the CPUs slows every figure)",
             f"Corpus: {mb(c['bytes'])} of text, {c['documents']:,} documents in {c['files']} JSON Lines files; "
             f"{p['tokens']:,} tokens ({p['tokens'] / c['bytes']:.3f} per byte); tokenizer {figures['tokenizer']}",
             "",
             "| Figure | Value | Goal | Result |",
             "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {g} | {v} |" for a, b, g, v in rows]
    lines += ["",
              f"Prepare: {p['seconds']:.1f} s end to end ({p['split_mb_per_s']:.2f} MB/s over its splits' own "
              f"{p['split_seconds']:.1f} s); raw: {raw['seconds']:.1f} s ({raw['parts']} parts: half the files "
              f"before preparing, half after). CPU time (user + system): prepare {p['cpu_seconds']:.1f} s, raw "
              f"{raw['cpu_seconds']:.1f} s. Peak RSS: wait4's ru_maxrss (largest "
              f"process, exit included) {mb(p['ru_maxrss'])}; largest sampled RSS sum over the process tree "
              f"{mb(p['peak_tree_rss_sampled'])}. Loader: first batch after {loader['first_batch_seconds']:.2f} s, "
              f"then {loader['batches']} batches in {loader['seconds']:.1f} s. Training step: "
              f"{step['seconds_per_step']:.2f} s.",
              "Checks (prepare's documents and bytes are the corpus's, its tokens the raw ones plus one eos per "
              "document, its rows whole): " + ", ".join(f"{k} {'ok' if v else 'MISMATCH'}"
                                                         for k, v in figures["checks"].items())
              + f". Benchmark wall time: {figures.get('seconds', 0):.0f} s."]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.data", description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=float, default=1024, help="corpus size in MB of text (default %(default)s)")
    p.add_argument("--workers", type=int, default=None,
                   help="prepare's --workers and raw's threads (default: the CPUs)")
    p.add_argument("--tokenizer", default=None,
                   help=f"tokenizer spec (default: {DEFAULT_TOKENIZER} if present, else a "
                        "bpe:2048 trained on 2 MB of the corpus)")
    p.add_argument("--json", metavar="FILE", help="also write the figures to FILE")
    p.add_argument("--work-dir", default=None, help="where the temporary folder goes (default: the system's)")
    p.add_argument("--keep", action="store_true", help="keep the corpus and the prepared data")
    p.add_argument("--seed", type=int, default=0, help="corpus seed (default %(default)s)")
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="training config of the model and loader")
    p.add_argument("--loader-seconds", type=float, default=5.0,
                   help="how long to read the loader (default %(default)s)")
    p.add_argument("--steps", type=int, default=5, help="timed training steps (default %(default)s)")
    p.add_argument("--warmup", type=int, default=2, help="untimed training steps first (default %(default)s)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    figures = run(args.size_mb, args.workers, args.tokenizer, work_dir=args.work_dir, keep=args.keep,
                  seed=args.seed, config=args.config, loader_seconds=args.loader_seconds, steps=args.steps,
                  warmup=args.warmup)
    print(table(figures))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")
    return 0 if all(figures["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
