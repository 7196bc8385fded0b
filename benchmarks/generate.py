"""Decoding benchmarks, each mode measured against its peer in the same run (``python -m benchmarks.generate``).

Two tables, and a third on request (``--linear``):

- speculative decoding: tokens/s of plain greedy, reference decoding (prompt lookup / LLMA)
  and draft-model decoding, on a copy-heavy task (the prompt holds a passage that the answer
  repeats) and on free generation, with a check that every mode's greedy tokens are identical;
- transformers side by side: the same weights in transformers' ``LlamaForCausalLM`` against
  ours, prefill and decode tokens/s at batch 1 and 8, dynamic and static caches;
- projections: the time of all of the pretrained model's linear layers at 1-64 rows, torch's
  ``F.linear`` against the thread split of :mod:`llm.layers.linear`.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from llm.cache import StaticCache
from llm.data.tokenizer import load_tokenizer
from llm.data import load_corpus
from llm.generation.generate import generate
from llm.layers.linear import linear
from llm.model import MosaicGPT


def _timed_interleaved(fns, repeats: int, min_total_s: float = 2.0, max_repeats: int = 50):
    """Time calls taking turns (a, b, a, b, ...): a slow spell of a shared machine then falls on
    every side of a comparison, not on one.

    After one warm-up round, rounds run until there have been ``repeats`` and every call has
    been timed for ``min_total_s`` seconds in all (at most ``max_repeats`` rounds): a best-of-2
    of a 0.2 s call is mostly scheduler noise. Returns one (best seconds, last result) per call.
    """
    results = [fn() for fn in fns]
    best, total = [float("inf")] * len(fns), [0.0] * len(fns)
    runs = 0
    while runs < repeats or (min(total) < min_total_s and runs < max_repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            results[i] = fn()
            seconds = time.perf_counter() - start
            best[i], total[i] = min(best[i], seconds), total[i] + seconds
        runs += 1
    return list(zip(best, results))


class TokenClock:
    """A streamer (transformers' ``put``/``end`` protocol, which our :func:`generate` and
    transformers' ``generate`` both call) that notes when each step's new tokens arrive.

    The first ``put`` is the prompt and is skipped; every later one (or :meth:`tick`, for engines
    that call back with new ids only, as :meth:`benchmarks.peers.LlamaCpp.greedy`) records
    ``time.perf_counter()`` and the tokens per row it brought (``ids``' elements / ``batch``).

    Args:
        batch: rows decoded side by side.
    """

    def __init__(self, batch: int = 1):
        self.batch, self.times, self.tokens, self._prompt_seen = batch, [], [], False

    def put(self, ids) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.tick(ids)

    def tick(self, ids) -> None:
        self.times.append(time.perf_counter())
        self.tokens.append(max(1, math.prod(ids.shape) // self.batch))

    def end(self) -> None:
        pass

    def decode_tokens_per_s(self) -> float:
        """New tokens of all rows after the first step's, per second from that step to the last
        (nan with fewer than two steps): the decode rate without the prefill, measured inside
        one call, so that neither the prefill's time nor its noise lands on it."""
        if len(self.times) < 2 or self.times[-1] <= self.times[0]:
            return float("nan")
        return self.batch * sum(self.tokens[1:]) / (self.times[-1] - self.times[0])


def decode_rounds(fns, rounds: int) -> list[tuple[list[float], object]]:
    """Decode rates of calls taking turns, one warm-up round, then ``rounds``; each round starts
    one call further on (a, b, c; b, c, a; ...), so that no call always follows the same one.

    Args:
        fns: callables returning (result, decode tokens/s of that call), e.g. from a
            :class:`TokenClock`.

    Returns:
        One (the rate of every timed round, in order; the last result) per call. Compare engines
        by the median of their per-round ratios (:func:`versus`): a slow spell of a shared machine
        then falls on both sides of each ratio.

    Raises:
        ValueError: if a call gives no finite positive rate (fewer than two steps timed).
    """
    results = [fn()[0] for fn in fns]
    rates = [[] for _ in fns]
    for r in range(rounds):
        for i in [(r + j) % len(fns) for j in range(len(fns))]:
            results[i], rate = fns[i]()
            if not (math.isfinite(rate) and rate > 0):
                raise ValueError(f"call {i} of round {r} gave no decode rate ({rate}): it timed fewer than two steps")
            rates[i].append(rate)
    return list(zip(rates, results))


def versus(rates: list[float], reference: list[float]) -> tuple[float, float, float]:
    """(median, lowest, highest) of the per-round ratios ``rates[r] / reference[r]`` of two
    :func:`decode_rounds` entries."""
    ratios = [r / ref for r, ref in zip(rates, reference, strict=True)]
    return statistics.median(ratios), min(ratios), max(ratios)


def copy_prompt(tokenizer, max_tokens: int | None) -> str:
    """A prompt whose natural continuation repeats a passage of held-out Shakespeare.

    The passage is shown twice and a third copy is begun, so a model that copies (induction
    heads) continues it verbatim; an instruction such as "repeat this text" is not followed
    reliably by small models (SmolLM2-135M-Instruct paraphrases). Cut to ``max_tokens``.
    """
    passage = load_corpus("validation")[20000:20900]
    passage = passage[passage.index("\n") + 1:]
    while True:
        prompt = f"{passage}\n\n{passage}\n\n{passage[:40]}"
        if max_tokens is None or len(tokenizer(prompt).input_ids) <= max_tokens:
            return prompt
        passage = passage[: int(len(passage) * 0.9)]


def free_prompt(tokenizer, chat: bool) -> str:
    if chat:
        messages = [{"role": "user", "content": "Write a short story about a fox and a crow."}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "ROMEO:\n"


def speculative_table(model, tokenizer, draft, *, chat: bool, new_tokens: int, repeats: int, lookup_tokens: int,
                      draft_tokens: int) -> list[dict]:
    """Rows of task, mode, tokens/s, speed-up over greedy, acceptance and an identical-output check."""
    rows = []
    if model.config.learned_pos_emb:  # prompt + new tokens must fit the position table
        new_tokens = min(new_tokens, model.config.max_seq_len // 3)
    budget = model.config.max_seq_len - new_tokens if model.config.learned_pos_emb else None
    for task, prompt in (("copy", copy_prompt(tokenizer, budget)), ("free", free_prompt(tokenizer, chat))):
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids.to(model.device)
        modes = {"greedy": {}, "lookup": dict(prompt_lookup_num_tokens=lookup_tokens, max_matching_ngram_size=3)}
        if draft is not None:
            modes["draft"] = dict(assistant_model=draft, num_assistant_tokens=draft_tokens)
        # the modes take turns, so that a slow spell of the machine does not fall on one of them; all
        # greedy (a registered model's generation_config may sample), so their tokens must agree
        timed = _timed_interleaved([
            lambda extra=extra: generate(model, ids, max_new_tokens=new_tokens, do_sample=False,
                                         return_dict_in_generate=True, **extra)
            for extra in modes.values()
        ], repeats)
        reference = None
        for mode, (seconds, out) in zip(modes, timed):
            new = out.sequences[0, ids.shape[1]:]
            if reference is None:
                reference, base = new, seconds
            s = out.stats
            rows.append(dict(
                task=task, mode=mode, prompt_tokens=ids.shape[1], new_tokens=int(new.numel()),
                tokens_per_s=new.numel() / seconds, speedup=base / seconds,
                forward_passes=s["forward_passes"],
                acceptance=s["accepted_tokens"] / s["proposed_tokens"] if s["proposed_tokens"] else None,
                identical=bool(torch.equal(new, reference)),
            ))
    return rows


def transformers_table(model, hf_model, tokenizer, *, new_tokens: int, repeats: int, batches=(1, 8)) -> list[dict]:
    """Prefill and decode tokens/s of ours against transformers' on the same weights and prompts."""
    from transformers import DynamicCache as HFDynamicCache
    from transformers import StaticCache as HFStaticCache

    text = load_corpus("validation")[5000:5600]
    rows = []
    for batch in batches:
        ids = tokenizer([text] * batch, return_tensors="pt", add_special_tokens=False).input_ids
        total = ids.shape[1] + new_tokens
        for cache_kind in ("dynamic", "static"):
            def ours(n):
                cache = StaticCache(model.config, batch, total) if cache_kind == "static" else None
                return generate(model, ids, past_key_values=cache, max_new_tokens=n, do_sample=False)

            def theirs(n):
                cache = (HFStaticCache(config=hf_model.config, max_batch_size=batch, max_cache_len=total)
                         if cache_kind == "static" else HFDynamicCache())
                return hf_model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                                         max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                         pad_token_id=tokenizer.pad_token_id)

            with torch.no_grad():
                # Both sides the same way: a generate of one token is the prefill, and decoding
                # is the rest of a generate of new_tokens.
                (p_ours, _), (p_theirs, _) = _timed_interleaved([lambda: ours(1), lambda: theirs(1)], repeats)
                (t_ours, out_ours), (t_theirs, out_theirs) = _timed_interleaved(
                    [lambda: ours(new_tokens), lambda: theirs(new_tokens)], repeats)
            d_ours = batch * (new_tokens - 1) / max(t_ours - p_ours, 1e-9)
            d_theirs = batch * (new_tokens - 1) / max(t_theirs - p_theirs, 1e-9)
            rows.append(dict(
                batch=batch, cache=cache_kind, prompt_tokens=ids.shape[1],
                prefill_tokens_per_s=batch * ids.shape[1] / p_ours,
                hf_prefill_tokens_per_s=batch * ids.shape[1] / p_theirs,
                decode_tokens_per_s=d_ours, hf_decode_tokens_per_s=d_theirs, decode_ratio=d_ours / d_theirs,
                identical=bool(torch.equal(out_ours, out_theirs)),
            ))
    return rows


def linear_table(model, rows=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64), repeats: int = 3) -> list[dict]:
    """Milliseconds for ALL of a model's projections (every linear layer and a tied head) applied
    to a few rows: ``F.linear`` against :func:`llm.layers.linear.linear`'s thread split, taking turns."""
    weights = [m.weight for m in model.modules() if isinstance(m, nn.Linear)]
    if model.lm_head is None:
        weights.append(model.wte.weight)
    table = []
    with torch.no_grad():
        for n in rows:
            inputs = {w.shape[1]: torch.randn(n, w.shape[1], dtype=w.dtype) for w in weights}
            (t_ref, _), (t_split, _) = _timed_interleaved([
                lambda: [F.linear(inputs[w.shape[1]], w) for w in weights],
                lambda: [linear(inputs[w.shape[1]], w) for w in weights],
            ], repeats, min_total_s=1.0)
            table.append(dict(rows=n, f_linear_ms=t_ref * 1e3, split_ms=t_split * 1e3, speedup=t_ref / t_split))
    return table


def markdown(rows: list[dict]) -> str:
    """A markdown table of rows of dicts (floats to 2 decimals)."""
    if not rows:
        return ""
    keys = list(rows[0])
    fmt = lambda v: f"{v:.2f}" if isinstance(v, float) else ("-" if v is None else str(v))
    lines = ["| " + " | ".join(keys) + " |", "|" + " --- |" * len(keys)]
    lines += ["| " + " | ".join(fmt(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def hf_llama(model):
    """transformers' ``LlamaForCausalLM`` holding the weights of a Llama-style MosaicGPT (fp32, eval)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = model.config
    hf = LlamaForCausalLM(LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.d_model, intermediate_size=c.hidden_size,
        num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads, num_key_value_heads=c.kv_n_heads,
        max_position_embeddings=c.max_seq_len, rope_theta=c.rope_theta, rms_norm_eps=c.layer_norm_epsilon,
        tie_word_embeddings=c.tie_word_embeddings, attn_implementation="sdpa",
    ))
    q, kv = c.n_heads * c.head_dim, c.kv_n_heads * c.head_dim
    state = {"model.embed_tokens.weight": model.wte.weight, "model.norm.weight": model.norm_f.weight}
    if model.lm_head is not None:
        state["lm_head.weight"] = model.lm_head.weight
    for i, block in enumerate(model.blocks):
        h = f"model.layers.{i}."
        wq, wk, wv = block.attn.Wqkv.weight.split([q, kv, kv])
        state.update({
            h + "input_layernorm.weight": block.norm_1.weight, h + "post_attention_layernorm.weight": block.norm_2.weight,
            h + "self_attn.q_proj.weight": wq, h + "self_attn.k_proj.weight": wk, h + "self_attn.v_proj.weight": wv,
            h + "self_attn.o_proj.weight": block.attn.out_proj.weight, h + "mlp.gate_proj.weight": block.ffn.gate_proj.weight,
            h + "mlp.up_proj.weight": block.ffn.up_proj.weight, h + "mlp.down_proj.weight": block.ffn.down_proj.weight,
        })
    hf.load_state_dict({k: v.detach().clone() for k, v in state.items()}, strict=not c.tie_word_embeddings)
    return hf.eval()


def _decoding_tables(args) -> dict:
    """The speculative-decoding tables and the side-by-side with transformers, as ``args`` asks."""
    results = {}
    if not args.skip_speculative:
        model = MosaicGPT.from_pretrained(args.model)
        tokenizer = load_tokenizer(args.model)
        draft = MosaicGPT.from_pretrained(args.draft_model) if Path(args.draft_model).is_dir() else None
        results["shakespeare"] = speculative_table(
            model, tokenizer, draft, chat=False, new_tokens=args.new_tokens, repeats=args.repeats,
            lookup_tokens=args.lookup_tokens, draft_tokens=args.draft_tokens)
        print(f"## Speculative decoding, {args.model}\n\n{markdown(results['shakespeare'])}\n", flush=True)
    if args.pretrained == "none":
        return results
    model = MosaicGPT.from_pretrained(args.pretrained)
    tokenizer = load_tokenizer(args.pretrained)
    if not args.skip_speculative:
        results["pretrained"] = speculative_table(
            model, tokenizer, None, chat=True, new_tokens=args.new_tokens, repeats=args.repeats,
            lookup_tokens=args.lookup_tokens, draft_tokens=args.draft_tokens)
        print(f"## Speculative decoding, {args.pretrained}\n\n{markdown(results['pretrained'])}\n", flush=True)
    if not args.skip_transformers:
        results["transformers"] = transformers_table(model, hf_llama(model), tokenizer, new_tokens=64,
                                                     repeats=args.repeats)
        print(f"## Ours vs transformers, {args.pretrained}, fp32\n\n{markdown(results['transformers'])}\n",
              flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks; prints markdown tables and optionally writes JSON."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.generate", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="runs/shakespeare/model", help="the Shakespeare model bundle")
    p.add_argument("--draft-model", default="runs/shakespeare-draft/model", help="its draft model (skipped if absent)")
    p.add_argument("--pretrained", default="smollm2-135m-instruct", help="a pretrained model; 'none' to skip")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2, help="timed rounds of the calls taking turns (--fast: 5)")
    p.add_argument("--lookup-tokens", type=int, default=10)
    p.add_argument("--draft-tokens", type=int, default=4)
    p.add_argument("--skip-transformers", action="store_true", help="skip the side-by-side with transformers")
    p.add_argument("--skip-speculative", action="store_true", help="only the side-by-side with transformers")
    p.add_argument("--linear", action="store_true",
                   help="only the pretrained model's projections: F.linear against the thread split")
    p.add_argument("--fast", action="store_true",
                   help="only the fast-decoding table: our weight modes, compiled or not, against transformers and "
                        "llama.cpp (needs llama-cpp-python: run it with `make bench-peers`)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="--fast: batch sizes")
    p.add_argument("--bpb-blocks", type=int, default=16, help="--fast: held-out blocks scored for bits per byte")
    p.add_argument("--bpb-block-len", type=int, default=512, help="--fast: tokens per held-out block")
    p.add_argument("--no-extra-bufts", action="store_true",
                   help="--fast: keep llama.cpp off its extra CPU buffer types (AMX; probed, and off if they crash)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    if args.fast:
        from benchmarks.generate_fast import fast_table, print_fast

        args.new_tokens = 64 if args.new_tokens == p.get_default("new_tokens") else args.new_tokens
        args.repeats = 5 if args.repeats == p.get_default("repeats") else args.repeats
        if args.repeats < 1 or args.new_tokens < 2:
            p.error(f"--fast needs --repeats >= 1 and --new-tokens >= 2 (a decode rate needs two new tokens), "
                    f"got {args.repeats} and {args.new_tokens}")
        results = {"fast": fast_table(args)}
        print_fast(results["fast"])
    elif args.linear:
        results = {"linear": linear_table(MosaicGPT.from_pretrained(args.pretrained), repeats=args.repeats)}
        print(f"## Projections of {args.pretrained}, F.linear vs split over "
              f"{torch.get_num_threads()} threads\n\n{markdown(results['linear'])}\n", flush=True)
    else:
        results = _decoding_tables(args)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
