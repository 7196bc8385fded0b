"""``scripts/generate.py``: sample from a saved or registered model on the command line.

Completions go to stdout; prefill and decode speeds and the draft acceptance rate go to stderr.
A bad flag value or input exits with status 2 and a one-line message, not a traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from llm.cache import Cache, DynamicCache
from llm.convert.registry import generation_defaults, load_tokenizer
from llm.generation.generate import generate
from llm.model import MosaicGPT

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_TEMPERATURE = 0.8


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scripts/generate.py", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a saved model folder, a .gguf file or a registered name")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", type=Path, help="a file with one prompt per line")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    p.add_argument("--system", help="a system prompt / shared prefix, computed once and reused for every prompt")
    p.add_argument("--prompt-cache", type=Path, help="file holding the --system prefix's KV cache (made if absent)")
    p.add_argument("--batch-size", type=_positive_int, default=8)
    p.add_argument("--max-new-tokens", type=_positive_int, default=100)
    p.add_argument("--temperature", type=float,
                   help=f"0 for greedy decoding (default: the registered model's recommended setting, "
                        f"else {DEFAULT_TEMPERATURE})")
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float, help="(default: the registered model's recommended setting, else none)")
    p.add_argument("--min-p", type=float)
    p.add_argument("--repetition-penalty", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="stop a completion at this string (repeatable)")
    p.add_argument("--stream", action="store_true", help="print tokens as they are decoded")
    p.add_argument("--speculative", choices=["none", "lookup", "draft"], default="none",
                   help="lookup: copy drafts from the prompt (LLMA); draft: a smaller --draft-model")
    p.add_argument("--draft-model", help="the draft model for --speculative draft")
    p.add_argument("--num-speculative-tokens", type=_positive_int, default=5)
    p.add_argument("--speculative-schedule", choices=["heuristic", "constant"], default="heuristic",
                   help="heuristic: adapt the draft length and draft only while it pays; constant: always "
                        "--num-speculative-tokens (num_assistant_tokens_schedule)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    return p


def _prompts(args, parser) -> list[str]:
    prompts = list(args.prompt)
    if args.prompts_file is not None:
        if not args.prompts_file.is_file():
            parser.error(f"--prompts-file {args.prompts_file} does not exist")
        prompts += [line for line in args.prompts_file.read_text().splitlines() if line.strip()]
    if not prompts:
        parser.error("give at least one --prompt or a --prompts-file")
    return prompts


def _split(tokenizer, prompt: str, system: str | None, chat: bool) -> tuple[str, str]:
    """(shared prefix text, request text) of one prompt."""
    if not chat:
        return system or "", prompt
    messages = [{"role": "system", "content": system}] if system else []
    head = tokenizer.apply_chat_template(messages, tokenize=False) if messages else ""
    full = tokenizer.apply_chat_template(messages + [{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    if not full.startswith(head):  # a template that rewrites earlier turns: no shared prefix
        return "", full
    return head, full[len(head):]


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids if text else []


def _prefix_cache(model, prefix: list[int], path: Path | None) -> Cache | None:
    """The KV cache of the shared prefix: loaded from ``path`` if it holds this prefix, else computed."""
    if not prefix:
        return None
    if path is not None and path.is_file():
        cache = Cache.load(path, device=model.device)
        if cache.metadata.get("token_ids") == prefix:
            return cache
        print(f"{path} holds another prefix: recomputing it", file=sys.stderr)
    cache = DynamicCache()
    with torch.no_grad():
        model(torch.tensor([prefix], device=model.device), past_key_values=cache)
    if path is not None:
        cache.save(path, metadata={"token_ids": prefix})
    return cache


class _Printer:
    """A streamer (``put``/``end``) that prints the decoded text as it grows."""

    def __init__(self, tokenizer):
        self.tokenizer, self.tokens, self.printed, self.prompt_seen = tokenizer, [], 0, False

    def put(self, value):
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.tokens += value.reshape(-1).tolist()
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            print(text[self.printed:], end="", flush=True)
            self.printed = len(text)

    def end(self):
        print(flush=True)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0, or 2 through argparse for bad input)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    prompts = _prompts(args, parser)
    if args.speculative == "draft" and not args.draft_model:
        parser.error("--speculative draft needs --draft-model")
    if args.prompt_cache is not None and not args.system:
        parser.error("--prompt-cache holds the --system prefix: give --system too")
    try:
        dtype = DTYPES[args.dtype]
        model = MosaicGPT.from_pretrained(args.model, device=args.device, dtype=dtype)
        tokenizer = load_tokenizer(args.model)
        draft = None
        if args.speculative == "draft":
            draft = MosaicGPT.from_pretrained(args.draft_model, device=args.device, dtype=dtype)
        if args.chat and not tokenizer.chat_template:
            parser.error(f"--chat: the tokenizer of {args.model} has no chat template")
        # the user's flags, else the registered model's recommended sampling, else ours
        sampling = {"temperature": DEFAULT_TEMPERATURE, **generation_defaults(args.model)}
        sampling.update({k: getattr(args, k) for k in ("temperature", "top_k", "top_p", "min_p")
                         if getattr(args, k) is not None})
        options = dict(
            max_new_tokens=args.max_new_tokens, do_sample=sampling["temperature"] > 0,
            temperature=sampling["temperature"], top_k=sampling.get("top_k"), top_p=sampling.get("top_p"),
            min_p=sampling.get("min_p"), repetition_penalty=args.repetition_penalty,
            seed=args.seed, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
            stop_strings=args.stop, tokenizer=tokenizer if args.stop else None, return_dict_in_generate=True,
        )
        if args.speculative != "none":
            options.update(num_assistant_tokens_schedule=args.speculative_schedule)
        if args.speculative == "lookup":
            options.update(prompt_lookup_num_tokens=args.num_speculative_tokens, max_matching_ngram_size=3)
        elif args.speculative == "draft":
            options.update(assistant_model=draft, num_assistant_tokens=args.num_speculative_tokens)

        requests = [_split(tokenizer, p, args.system, args.chat) for p in prompts]
        prefix = _encode(tokenizer, requests[0][0])
        cache = _prefix_cache(model, prefix, args.prompt_cache)
        one_by_one = args.stream or args.speculative != "none"
        step = 1 if one_by_one else args.batch_size
        totals = {"prefill_tokens": 0, "new_tokens": 0, "proposed_tokens": 0, "accepted_tokens": 0,
                  "prefill_s": 0.0, "decode_s": 0.0}
        for start in range(0, len(requests), step):
            batch = [_encode(tokenizer, text) for _, text in requests[start:start + step]]
            if min(len(ids) for ids in batch) + len(prefix) == 0:
                parser.error("a prompt is empty")
            width = max(len(ids) for ids in batch)
            # [prefix][padding][request]: the model ignores padding wherever it stands
            ids = torch.tensor([prefix + [tokenizer.pad_token_id or 0] * (width - len(b)) + b for b in batch])
            mask = torch.tensor([[1] * len(prefix) + [0] * (width - len(b)) + [1] * len(b) for b in batch])
            past = cache.copy().select([0] * len(batch)) if cache is not None else None
            streamer = None
            if args.stream:
                streamer = _Printer(tokenizer)
                if not args.chat:
                    print(requests[start][1], end="", flush=True)
            out = generate(model, ids.to(model.device), attention_mask=mask.to(model.device), past_key_values=past,
                           streamer=streamer, **options)
            for row, (_, text) in enumerate(requests[start:start + step]):
                completion = tokenizer.decode(out.sequences[row, ids.shape[1]:], skip_special_tokens=True)
                if not args.stream:
                    print(completion if args.chat else text + completion)
                print(flush=True)
            for key in totals:
                totals[key] += out.stats[key]
    except (ValueError, FileNotFoundError) as err:
        parser.error(str(err))

    decode = (totals["new_tokens"] - len(requests)) / totals["decode_s"] if totals["decode_s"] else float("nan")
    line = (f"prefill: {totals['prefill_tokens']} tokens, {totals['prefill_tokens'] / max(totals['prefill_s'], 1e-9):.1f} tokens/s; "
            f"decode: {totals['new_tokens']} tokens, {decode:.1f} tokens/s")
    if args.speculative != "none":
        rate = totals["accepted_tokens"] / max(totals["proposed_tokens"], 1)
        line += f"; drafts: {totals['accepted_tokens']}/{totals['proposed_tokens']} accepted ({rate:.0%})"
    print(line, file=sys.stderr)
    return 0
