"""Sample from a saved or registered model on the command line.

Completions go to stdout; prefill and decode speeds and the draft acceptance rate go to stderr.
A bad flag value or input exits with status 2 and a one-line message (``llm generate: error:
...``), not a usage block or a traceback. Decoding options are checked by ``GenerationConfig``.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

from llm.cache import Cache, DynamicCache
from llm.cli.common import ArgumentParser, add_model_arguments, describe, integer, load_model, model_problem
from llm.generation.config import load_generation_config
from llm.data.text_tokenizer import IncrementalText
from llm.generation.config import GenerationConfig
from llm.generation.generate import generate
from llm.model import MosaicGPT

DEFAULT_TEMPERATURE = 0.8
# flags that set a sampling option (GenerationConfig's name -> flag), for the greedy warning
SAMPLING_FLAGS = {"temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p", "min_p": "--min-p"}


def _option(name: str, parse=int):
    """An argparse type: ``parse`` (int or float) the text, then check it as GenerationConfig's
    option ``name``."""

    def convert(text: str):
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if parse is int else 'a number'}, got {text!r}") from None
        try:
            GenerationConfig(do_sample=True, **{name: value})  # do_sample: no greedy warning here
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err).removeprefix(f"{name} ")) from None
        return value

    return convert


def build_parser(prog: str = "generate.py") -> argparse.ArgumentParser:
    p = ArgumentParser(prog=prog, description=describe(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="example:\n  llm generate --model smollm2-135m-instruct --chat --stream "
                              "--prompt \"What is the capital of Germany?\"\n  llm generate --model runs/shakespeare/model "
                              "--prompt \"ROMEO:\" --max-new-tokens 200")
    p.add_argument("--model", required=True, help="a saved model folder, a .gguf file or a registered name")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", type=Path, help="a file with one prompt per line")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    p.add_argument("--system", help="a system prompt / shared prefix, computed once and reused for every prompt")
    p.add_argument("--prompt-cache", type=Path,
                   help="file holding the --system prefix's KV cache (made if absent; remade, saying so, if it "
                        "is unreadable or from another model, tokenizer or dtype)")
    p.add_argument("--batch-size", type=integer(), default=8, help="prompts decoded together (default 8)")
    p.add_argument("--max-new-tokens", type=_option("max_new_tokens"), default=100,
                   help="the longest completion, in tokens (default 100)")
    p.add_argument("--temperature", type=_option("temperature", float),
                   help=f"0 for greedy decoding (default: the model's generation config, i.e. its "
                        f"generation_config.json or a registered model's recommended settings, else "
                        f"sampling at {DEFAULT_TEMPERATURE})")
    p.add_argument("--top-k", type=_option("top_k"), help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=_option("top_p", float), help="(default: the model's generation config, else none)")
    p.add_argument("--min-p", type=_option("min_p", float),
                   help="drop tokens less likely than this fraction of the most likely one's probability")
    p.add_argument("--repetition-penalty", type=_option("repetition_penalty", float),
                   help="CTRL's penalty on tokens already seen (1 is none; above 1 discourages repeats)")
    p.add_argument("--seed", type=_option("seed"), help="seed of the sampler (the same seed gives the same text)")
    p.add_argument("--stop", action="append", help="stop a completion at this string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="go on past the end-of-text and end-of-turn tokens: --max-new-tokens tokens unless a "
                        "--stop string ends the text first (llama.cpp's flag, for benchmarks)")
    p.add_argument("--stream", action="store_true", help="print tokens as they are decoded")
    p.add_argument("--speculative", choices=["none", "lookup", "draft"], default="none",
                   help="lookup: copy drafts from the prompt (LLMA); draft: a smaller --draft-model")
    p.add_argument("--draft-model", help="the draft model for --speculative draft")
    p.add_argument("--num-speculative-tokens", type=_option("num_assistant_tokens"), default=5,
                   help="tokens drafted per step (default 5)")
    p.add_argument("--speculative-schedule", choices=["heuristic", "constant"], default="heuristic",
                   help="heuristic: adapt the draft length and draft only while it pays; constant: always "
                        "--num-speculative-tokens (num_assistant_tokens_schedule)")
    add_model_arguments(p, compile_help=("decode through torch.compile over a static cache (the first call of a shape compiles, "
                        "or loads inductor's disk cache; needs a C++ compiler, else runs uncompiled with a warning)"))
    return p


def _prompts(args, parser) -> list[str]:
    prompts = list(args.prompt)
    if args.prompts_file is not None:
        path = args.prompts_file
        try:
            data = path.read_bytes()
        except OSError as err:
            parser.error(f"--prompts-file {path}: {err.strerror or err}")
        try:
            text = data.decode("utf-8").removeprefix("\ufeff")  # a byte order mark is no prompt text
        except UnicodeDecodeError as err:
            parser.error(f"--prompts-file {path} is not UTF-8 text: byte 0x{data[err.start]:02x} at byte offset "
                         f"{err.start} ({err.reason})")
        lines = [line for line in text.splitlines() if line.strip()]
        if not lines:
            parser.error(f"--prompts-file {path} holds no prompt: give one per line")
        prompts += lines
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


def _prefix_cache(model, tokenizer, prefix: list[int], path: Path | None) -> Cache | None:
    """The KV cache of the shared prefix: loaded from ``path`` if it holds this prefix, made by this
    model and tokenizer, else computed (and written to ``path``). A file that is not a readable
    cache, or comes from another model (same shape or not), tokenizer or dtype, or holds another
    prefix, is recomputed and overwritten, with one line on stderr saying which file and why; never
    an error, as the --system text that --prompt-cache requires is always there to recompute from."""
    if not prefix:
        return None
    if path is not None and path.is_file():
        try:
            cache = Cache.load(path, model=model, tokenizer=tokenizer)
        except ValueError as err:  # the message names the file and what does not match
            print(f"{err}: recomputing the prefix", file=sys.stderr)
        else:
            if cache.metadata.get("token_ids") == prefix:
                return cache
            print(f"{path} holds another prefix: recomputing it", file=sys.stderr)
    cache = DynamicCache()
    with torch.no_grad():
        model(torch.tensor([prefix], device=model.device), past_key_values=cache)
    if path is not None:
        cache.save(path, metadata={"token_ids": prefix}, model=model, tokenizer=tokenizer)
    return cache


class _Printer:
    """A streamer (``put``/``end``) that prints the decoded text as it grows."""

    def __init__(self, tokenizer):
        self.text, self.prompt_seen = IncrementalText(tokenizer), False

    def put(self, value):
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        piece = self.text.add(value.reshape(-1).tolist())  # "" until a multi-byte character is whole
        if piece:
            print(piece, end="", flush=True)

    def end(self):
        print(flush=True)


def _generation_config(args, tokenizer, prog: str) -> GenerationConfig:
    """The model's generation config (its generation_config.json, or a registered model's
    recommended settings), else sampling at DEFAULT_TEMPERATURE; the flags override either.

    Prints one warning line when greedy decoding ignores a sampling flag.

    Raises:
        ValueError: for options that GenerationConfig refuses (or a bad generation_config.json).
    """
    base = load_generation_config(args.model) or GenerationConfig(do_sample=True, temperature=DEFAULT_TEMPERATURE)
    flags = {name: getattr(args, name) for name in (*SAMPLING_FLAGS, "repetition_penalty", "seed")
             if getattr(args, name) is not None}
    if args.temperature is not None:
        flags["do_sample"] = args.temperature > 0
    overrides = dict(flags, max_new_tokens=args.max_new_tokens, return_dict_in_generate=True)
    # the model's eos and pad ids if its generation config has them, else the tokenizer's
    if base.eos_token_id is None:
        overrides["eos_token_id"] = tokenizer.eos_token_id
    if base.pad_token_id is None:
        overrides["pad_token_id"] = tokenizer.pad_token_id
    if args.ignore_eos:
        overrides["eos_token_id"] = None
    if args.stop:
        overrides["stop_strings"] = args.stop
    if args.speculative != "none":
        overrides["num_assistant_tokens_schedule"] = args.speculative_schedule
    if args.speculative == "lookup":
        overrides.update(prompt_lookup_num_tokens=args.num_speculative_tokens, max_matching_ngram_size=3)
    elif args.speculative == "draft":
        overrides["num_assistant_tokens"] = args.num_speculative_tokens
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # said below, in the flags' own names
        options = base.update(**overrides)
    ignored = [name for name in options.ignored_sampling_options() if name in flags]
    if ignored:
        why = "--temperature 0" if args.temperature == 0 else "the model's generation config has do_sample=false"
        listed = ", ".join(f"{SAMPLING_FLAGS[name]} {flags[name]}" for name in ignored)
        print(f"{prog}: warning: decoding is greedy ({why}), so {listed} is ignored", file=sys.stderr)
    return options


def main(argv: list[str] | None = None, prog: str = "generate.py") -> int:
    """Run the CLI; returns the exit status (0, or 2 through argparse for bad input)."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    prompts = _prompts(args, parser)
    if model_problem(args.model):
        parser.error(model_problem(args.model))
    if args.speculative == "draft" and not args.draft_model:
        parser.error("--speculative draft needs --draft-model")
    if args.draft_model is not None and model_problem(args.draft_model):
        parser.error("--draft-model " + model_problem(args.draft_model))
    if args.prompt_cache is not None:
        if not args.system:
            parser.error("--prompt-cache holds the --system prefix: give a non-empty --system too")
        if args.prompt_cache.is_dir():
            parser.error(f"--prompt-cache {args.prompt_cache} is a folder: give a file name")
        if not args.prompt_cache.absolute().parent.is_dir():
            parser.error(f"--prompt-cache {args.prompt_cache}: no folder {args.prompt_cache.parent} to keep it in")
    try:
        tokenizer, model = load_model(args)
        dtype = getattr(torch, args.dtype)
        draft = None
        if args.speculative == "draft":
            draft = MosaicGPT.from_pretrained(args.draft_model, device=args.device, dtype=dtype,
                                              quantization=args.quantize, backend=args.backend)
        if args.chat and not tokenizer.chat_template:
            parser.error(f"--chat: the tokenizer of {args.model} has no chat template")
        options = _generation_config(args, tokenizer, parser.prog)

        requests = [_split(tokenizer, p, args.system, args.chat) for p in prompts]
        prefix = _encode(tokenizer, requests[0][0])
        cache = _prefix_cache(model, tokenizer, prefix, args.prompt_cache)
        one_by_one = args.stream or args.speculative != "none"
        step = 1 if one_by_one else args.batch_size
        totals = {"prefill_tokens": 0, "new_tokens": 0, "proposed_tokens": 0, "accepted_tokens": 0,
                  "prefill_s": 0.0, "decode_s": 0.0}
        for start in range(0, len(requests), step):
            batch = [_encode(tokenizer, text) for _, text in requests[start:start + step]]
            if min(len(ids) for ids in batch) + len(prefix) == 0:
                parser.error("a prompt is empty")
            width = max(len(ids) for ids in batch)
            needed = len(prefix) + width + options.max_new_tokens - 1
            if needed > model.config.max_seq_len:  # the server refuses these too
                parser.error(f"a prompt of {len(prefix) + width} tokens + --max-new-tokens {options.max_new_tokens} "
                             f"needs {needed} positions, more than the model's context of "
                             f"{model.config.max_seq_len}: lower --max-new-tokens")
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
                           streamer=streamer, generation_config=options, tokenizer=tokenizer, assistant_model=draft,
                           compile=args.compile)
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
    if args.compile:
        line += " (compiling the first call's steps is counted in these figures)"
    print(line, file=sys.stderr)
    return 0
