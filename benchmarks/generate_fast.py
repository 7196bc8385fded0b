"""The fast-decoding table (``python -m benchmarks.generate --fast``): every weight mode of ours, compiled
or not, on torch's int4/int8 kernels and (compiled int8 and GGUF-native, where they run) on our
own (:mod:`llm.kernels.cpu_quant`), against transformers and llama.cpp on the same GGUF file, in
one run.

For each engine: decode tokens/s at batch 1 and 8 (greedy, the same prompt token ids, the same
new tokens, the same thread count), prefill tokens/s and time to first token at batch 1 (a
generate of one token), load time and peak RSS (each engine loaded and run in a process of its
own: :func:`benchmarks.peers.child_peak_rss`), the first call's seconds in a fresh process
with inductor's disk cache cold and warm (compiled modes), and held-out bits per byte on the
Shakespeare validation plays (the same blocks of the model's tokens for every engine, llama.cpp's
from its own logits). The decoding of all engines takes turns in one process (a slow spell of the
machine falls on all of them), round after round; the decode rate of a call is timed inside it,
from its first new token to its last (:class:`~benchmarks.generate.TokenClock`), so the prefill
and its noise stay out of it. Each engine's figure is the median over the rounds, and its ratio to
llama.cpp the median of the per-round ratios. llama.cpp is also timed alone in a process without
torch, to check that sharing a process does not slow it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from llm.data.tokenizer import load_tokenizer
from llm.utils.pretrained import resolve
from llm.data import load_corpus
from benchmarks.generate import TokenClock, _timed_interleaved, decode_rounds, hf_llama, markdown, versus
from llm.generation.generate import generate
from benchmarks.peers import LlamaCpp, child_peak_rss, extra_bufts_usable, llama_cpp_missing, run_alone
from llm.kernels import cpu_quant
from llm.model import MosaicGPT

#: Our modes: (quantization, compiled, kernels): "torch" for torch's int4/int8 kernels (the
#: backend "torch"), "llm" for ours (llm/kernels/cpu_quant.cpp, backend "llm").
OURS = [("none", False, "torch"), ("none", True, "torch"), ("int8", False, "torch"), ("int8", True, "torch"),
        ("int4", False, "torch"), ("int4", True, "torch"), ("gguf", False, "torch"), ("gguf", True, "torch"),
        ("int8", True, "llm"), ("gguf", True, "llm")]


def mode_name(quantization: str, compiled: bool, kernels: str = "torch") -> str:
    return (f"ours {'fp32' if quantization == 'none' else quantization}{' compiled' if compiled else ''}"
            f"{', our kernels' if kernels == 'llm' else ''}")


def prompt_ids(tokenizer, tokens: int = 171) -> list[int]:
    """A prompt of ``tokens`` ids of held-out Shakespeare (the transformers table's text)."""
    ids = tokenizer(load_corpus("validation")[5000:8000], add_special_tokens=False).input_ids
    return ids[:tokens]


def eval_blocks(tokenizer, blocks: int, length: int) -> tuple[list[list[int]], int]:
    """``blocks`` blocks of ``length`` ids evenly spread over the validation plays, and the UTF-8
    bytes of the tokens they predict (every token but each block's first)."""
    ids = tokenizer(load_corpus("validation"), add_special_tokens=False).input_ids
    step = (len(ids) - length) // max(blocks - 1, 1)
    chosen = [ids[i * step:i * step + length] for i in range(blocks)]
    return chosen, sum(len(tokenizer.decode(b[1:]).encode("utf-8")) for b in chosen)


def bits_per_byte(nll_nats: float, n_bytes: int) -> float:
    return nll_nats / math.log(2) / n_bytes


@torch.no_grad()
def ours_nll(model, blocks) -> float:
    """Summed next-token cross-entropy (nats) of ``model`` over the blocks."""
    total = 0.0
    for block in blocks:
        ids = torch.tensor([block])
        logits = model(ids).logits[0, :-1].float()
        total += float(F.cross_entropy(logits, ids[0, 1:], reduction="sum"))
    return total


def llama_nll(llama: LlamaCpp, blocks) -> float:
    total = 0.0
    for block in blocks:
        logits = torch.from_numpy(llama.logits(block)[:-1]).float()
        total += float(F.cross_entropy(logits, torch.tensor(block[1:]), reduction="sum"))
    return total


def load_ours(name: str, quantization: str, backend: str = "torch") -> MosaicGPT:
    return MosaicGPT.from_pretrained(name, quantization=quantization, backend=backend)


def _child(args) -> int:
    """One engine in this process: load it, time the first call (compiling, or loading inductor's
    cache), print the figures as JSON; the parent reads this process's peak RSS."""
    start = time.perf_counter()
    tokenizer = load_tokenizer(args.pretrained)
    ids = torch.tensor([prompt_ids(tokenizer)])
    if args.child == "hf":
        model = hf_llama(load_ours(args.pretrained, "none"))
        if args.compile:
            model.forward = torch.compile(model.forward, dynamic=False)
    else:
        model = load_ours(args.pretrained, args.child, args.backend)
    load_s = time.perf_counter() - start
    start = time.perf_counter()
    _generate(args.child == "hf", model, ids, 8, args.compile, tokenizer)
    print(json.dumps({"load_s": load_s, "first_call_s": time.perf_counter() - start}))
    return 0


def _generate(hf: bool, model, ids, n: int, compile: bool, tokenizer, streamer=None):
    if not hf:
        # never stopping early, as transformers' min_new_tokens and llama.cpp's greedy below
        return generate(model, ids, max_new_tokens=n, do_sample=False, compile=compile, streamer=streamer,
                        eos_token_id=None, stop_strings=None)
    from transformers import StaticCache as HFStaticCache

    cache = (HFStaticCache(config=model.config, max_batch_size=ids.shape[0], max_cache_len=ids.shape[1] + n)
             if compile else None)
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=n,
                              min_new_tokens=n, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                              streamer=streamer)


def clocked(call, batch: int):
    """``call(k, streamer)`` (``k`` new tokens) as a ``decode_rounds`` entry: returns (result,
    decode tokens/s measured by a :class:`TokenClock` inside that call)."""
    def run(k: int):
        clock = TokenClock(batch)
        return call(k, clock), clock.decode_tokens_per_s()
    return run


def _in_child(args, engine: str, compile: bool, cache_dir: str, kernels: str = "torch") -> dict:
    argv = [sys.executable, "-m", "benchmarks.generate_fast", "--child", engine, "--pretrained", args.pretrained,
            "--threads", str(torch.get_num_threads()), "--backend", kernels] + (["--compile"] if compile else [])
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir}
    status, out, err, rss_kb = child_peak_rss(argv, timeout=1800, env=env)
    if status != 0:
        raise RuntimeError(f"{engine} child exited with {status}: {err[-800:]}")
    return {**json.loads(out.strip().splitlines()[-1]), "peak_rss_mb": rss_kb / 1024}


def fast_table(args) -> dict:
    """All rows; see the module docstring."""
    missing = llama_cpp_missing()
    if missing:
        raise SystemExit(f"python -m benchmarks.generate --fast: {missing}")
    threads = torch.get_num_threads()
    kind, path = resolve(args.pretrained)
    if kind != "gguf":
        raise SystemExit(f"python -m benchmarks.generate --fast: --pretrained must be a GGUF model, llama.cpp's format; got {path}")
    gguf_path = str(path)
    tokenizer = load_tokenizer(args.pretrained)
    prompt = prompt_ids(tokenizer)
    ids = torch.tensor([prompt])
    n = args.new_tokens
    cache_dir = tempfile.mkdtemp(prefix="llm-bench-inductor-")

    # processes of their own: load time, peak RSS, the first call cold and warm
    why = cpu_quant.unavailable()
    if why:
        print(f"rows of our kernels left out: {why}", file=sys.stderr, flush=True)
    ours = [mode for mode in OURS if mode[2] == "torch" or why is None]
    engines = ours + [("hf", False, "torch"), ("hf", True, "torch")]
    alone = {}
    for engine, compile, kernels in engines:
        cold = _in_child(args, engine, compile, cache_dir, kernels)
        if compile:
            cold["warm_first_call_s"] = _in_child(args, engine, compile, cache_dir, kernels)["first_call_s"]
        alone[(engine, compile, kernels)] = cold
        print(f"alone: {engine} compile={compile} kernels={kernels}: {cold}", file=sys.stderr, flush=True)
    # llama.cpp's repacked (AMX) weights die with SIGILL on VMs whose AMX tiles are unusable
    extra_bufts = not args.no_extra_bufts and extra_bufts_usable(gguf_path, n_threads=threads)
    llama_alone = run_alone(gguf_path, prompt, n, n_threads=threads, use_extra_bufts=extra_bufts)

    # one process: every engine, taking turns (compiled steps load from the cache just filled)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    models = {}
    for q, _, kernels in ours:
        if (q, kernels) not in models:
            models[(q, kernels)] = load_ours(args.pretrained, q, kernels)
    hf = hf_llama(models[("none", "torch")])
    hf_compiled = hf_llama(models[("none", "torch")])
    hf_compiled.forward = torch.compile(hf_compiled.forward, dynamic=False)
    llama = {b: LlamaCpp(gguf_path, n_threads=threads, n_ctx=b * (len(prompt) + n + 16), n_seq_max=b,
                         use_extra_bufts=extra_bufts) for b in args.batches}
    rows = {}
    for batch in args.batches:
        batch_ids = ids.expand(batch, -1).contiguous()
        calls = {mode_name(q, c, kn): (lambda k, clock=None, m=models[(q, kn)], c=c:
                                       _generate(False, m, batch_ids, k, c, tokenizer, clock)) for q, c, kn in ours}
        calls["transformers eager"] = lambda k, clock=None: _generate(True, hf, batch_ids, k, False, tokenizer, clock)
        calls["transformers static compiled"] = lambda k, clock=None: _generate(True, hf_compiled, batch_ids, k, True,
                                                                                tokenizer, clock)
        calls["llama.cpp"] = lambda k, clock=None: torch.from_numpy(
            llama[batch].greedy([prompt] * batch, k, on_token=clock and clock.tick))
        names = list(calls)
        first = _timed_interleaved([lambda f=calls[m]: f(1) for m in names], args.repeats, min_total_s=1.0)
        decoded = decode_rounds([lambda f=clocked(calls[m], batch): f(n) for m in names], args.repeats)
        reference = decoded[names.index("llama.cpp")][0]
        for name, (t1, _), (rates, out) in zip(names, first, decoded):
            row = rows.setdefault(name, {"engine": name})
            mid, low, high = versus(rates, reference)
            row[f"decode_b{batch}"] = statistics.median(rates)
            row[f"vs_llama_cpp_b{batch}"], row[f"range_b{batch}"] = mid, f"{low:.2f}-{high:.2f}"
            new = out[:, -n:] if name != "llama.cpp" else out
            row.setdefault("_tokens", {})[batch] = new
            if batch == 1:
                row["prefill"], row["ttft_s"] = len(prompt) / t1, t1
        print(f"timed batch {batch}", file=sys.stderr, flush=True)

    blocks, n_bytes = eval_blocks(tokenizer, args.bpb_blocks, args.bpb_block_len)
    quality = {key: bits_per_byte(ours_nll(m, blocks), n_bytes) for key, m in models.items()}
    llama_bpb = bits_per_byte(llama_nll(LlamaCpp(gguf_path, n_threads=threads, n_ctx=args.bpb_block_len + 16,
                                                 use_extra_bufts=extra_bufts), blocks), n_bytes)
    table = []
    for engine, compile, kernels in engines + [("llama.cpp", False, "torch")]:
        if engine == "llama.cpp":
            name, fig = "llama.cpp", {"load_s": llama_alone["load_s"], "peak_rss_mb": llama_alone["peak_rss_mb"]}
            bpb = llama_bpb
        elif engine == "hf":
            name = "transformers static compiled" if compile else "transformers eager"
            fig, bpb = alone[(engine, compile, kernels)], quality[("none", "torch")]
        else:
            name, fig, bpb = mode_name(engine, compile, kernels), alone[(engine, compile, kernels)], quality[(engine, kernels)]
        row = rows[name]
        table.append(dict(
            engine=name, decode_b1=row["decode_b1"], decode_b8=row.get("decode_b8"),
            vs_llama_cpp=row["vs_llama_cpp_b1"], vs_range=row["range_b1"], prefill=row["prefill"], ttft_s=row["ttft_s"],
            load_s=fig["load_s"], first_call_cold_s=fig.get("first_call_s") if compile else None,
            first_call_warm_s=fig.get("warm_first_call_s"), peak_rss_mb=fig["peak_rss_mb"], bits_per_byte=bpb,
        ))
    same = {}
    for q, kernels in models:
        if mode_name(q, False, kernels) in rows and mode_name(q, True, kernels) in rows:
            eager, compiled_ = rows[mode_name(q, False, kernels)]["_tokens"], rows[mode_name(q, True, kernels)]["_tokens"]
            same[q] = all(torch.equal(eager[b], compiled_[b]) for b in eager)
    return {
        "table": table,
        "compiled_tokens_equal_eager": same,
        "llama_cpp_alone_decode": llama_alone["decode_tokens_per_s"],
        "llama_cpp_in_process_decode": rows["llama.cpp"]["decode_b1"],
        "llama_cpp_extra_bufts": extra_bufts,
        "threads": threads, "prompt_tokens": len(prompt), "new_tokens": n,
        "bpb_tokens": args.bpb_blocks * (args.bpb_block_len - 1), "bpb_bytes": n_bytes,
    }


def print_fast(results: dict) -> None:
    print(f"## Fast decoding, {results['threads']} threads, prompt {results['prompt_tokens']} tokens, "
          f"{results['new_tokens']} new (greedy)\n")
    print("decode: tokens/s from each call's first new token to its last, the median of the rounds taking turns; "
          "vs_llama_cpp: the median of the per-round ratios at batch 1 (vs_range: their range)\n")
    print(markdown(results["table"]))
    print(f"\nllama.cpp decode at batch 1: {results['llama_cpp_in_process_decode']:.1f} tokens/s in this process, "
          f"{results['llama_cpp_alone_decode']:.1f} alone; extra buffer types: {results['llama_cpp_extra_bufts']}")
    print(f"compiled tokens equal eager tokens: {results['compiled_tokens_equal_eager']}")
    print(f"bits per byte over {results['bpb_tokens']} predicted tokens ({results['bpb_bytes']} bytes)\n", flush=True)


def main(argv: list[str] | None = None) -> int:
    """``--child ENGINE``: one engine measured in this process (see :func:`_child`)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.generate_fast")
    p.add_argument("--child", required=True)
    p.add_argument("--pretrained", required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--backend", choices=["auto", "llm", "torch"], default="torch")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    return _child(args)


if __name__ == "__main__":
    sys.exit(main())
