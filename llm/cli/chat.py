"""``llm chat --model NAME``: talk to a chat model turn by turn on the terminal (one line per turn;
an empty line, end of input or Ctrl-C at the prompt ends the chat; Ctrl-C during an answer stops
that answer).

The answer streams as it is decoded. The conversation's KV cache is kept between turns: each turn
re-renders the whole conversation with the tokenizer's chat template and prefills only what
follows the longest prefix the cache already holds (cached == uncached, so the answer is the one a
fresh start would give).
"""

from __future__ import annotations

import argparse
import sys
import warnings

from llm.cli.common import ArgumentParser, add_model_arguments, describe, integer, load_model, model_problem
from llm.data.text_tokenizer import IncrementalText
from llm.utils.tokens import common_prefix

EXAMPLE = """example:
  llm chat --model smollm2-135m-instruct --system "You answer in one sentence."
"""


def build_parser(prog: str = "llm chat") -> argparse.ArgumentParser:
    p = ArgumentParser(prog=prog, description=describe(__doc__), epilog=EXAMPLE,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a saved model folder, a .gguf file or a registered name")
    p.add_argument("--system", help="a system prompt")
    p.add_argument("--max-new-tokens", type=integer(), default=256, help="the longest answer, in tokens")
    p.add_argument("--temperature", type=float, help="0 for greedy decoding (default: the model's generation config)")
    p.add_argument("--seed", type=integer(0))
    add_model_arguments(p, compile_help="decode through torch.compile over a static cache")
    return p


def main(argv: list[str] | None = None, prog: str = "llm chat") -> int:
    """Run the chat until an empty line or end of input; returns the exit status (2 for a bad input)."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if model_problem(args.model):
        parser.error(model_problem(args.model))
    import torch

    from llm.cache import DynamicCache
    from llm.generation.generate import stream

    try:
        tokenizer, model = load_model(args)
        if not tokenizer.chat_template:
            parser.error(f"the tokenizer of {args.model} has no chat template")
        overrides = {"max_new_tokens": args.max_new_tokens}
        if args.temperature is not None:
            overrides.update(do_sample=args.temperature > 0, temperature=args.temperature or 1.0)
        if args.seed is not None:
            overrides["seed"] = args.seed
        # the model's eos id if its generation config has one, else the tokenizer's (the end of a turn)
        if model.generation_config.eos_token_id is None:
            overrides["eos_token_id"] = tokenizer.eos_token_id
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # greedy decoding under a model's sampling defaults
            options = model.generation_config.update(**overrides)
    except (ValueError, FileNotFoundError) as err:
        parser.error(str(err))
    messages = [{"role": "system", "content": args.system}] if args.system else []
    cache, cached_ids = DynamicCache(), []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", flush=True)
        try:
            line = sys.stdin.readline()
        except KeyboardInterrupt:  # Ctrl-C at the prompt ends the chat
            print(flush=True)
            return 130
        if not line.strip():
            return 0
        messages.append({"role": "user", "content": line.strip()})
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        keep = min(common_prefix(cached_ids, ids), len(ids) - 1)  # at least one new token to prefill
        cache.crop(keep)
        text = IncrementalText(tokenizer)
        answer = text.ids
        try:
            for token in stream(model, torch.tensor([ids], device=model.device), past_key_values=cache,
                                generation_config=options, tokenizer=tokenizer, compile=args.compile):
                piece = text.add(token.view(-1).tolist())  # "" while a UTF-8 character is incomplete
                if piece:
                    print(piece, end="", flush=True)
            cached_ids = ids + answer[:-1]  # the last token was sampled, never fed back
        except KeyboardInterrupt:  # Ctrl-C while answering stops the answer, keeps what it said
            # the cache may hold a step half written: the next turn starts it afresh
            cache, cached_ids = DynamicCache(), []
        print(flush=True)
        messages.append({"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True)})

if __name__ == "__main__":
    sys.exit(main())
