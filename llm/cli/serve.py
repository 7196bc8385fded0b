"""Serve a model over an OpenAI-compatible HTTP API: ``llm serve --model M``.

Continuous batching (requests join and leave the running batch at every step), prefix caching,
streaming; GET /health, GET /metrics (Prometheus), GET /v1/models, POST /v1/completions,
POST /v1/chat/completions.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import threading

from llm.cli.common import ArgumentParser, add_model_arguments, describe, integer, load_model, model_problem


def build_parser(prog: str = "serve.py") -> argparse.ArgumentParser:
    p = ArgumentParser(prog=prog, description=describe(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="example:\n  llm serve --model smollm2-135m-instruct --port 8000 --max-batch-size 16\n"
                              "  curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' "
                              "-d '{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}]}'")
    p.add_argument("--model", required=True, help="a saved model folder, a .gguf file or a registered name")
    p.add_argument("--served-model-name", help="the model's id in the API (default: --model as given)")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1: this machine "
                                                       "only; 0.0.0.0: every interface)")
    p.add_argument("--port", type=integer(0, 65535), default=8000, help="the TCP port (default 8000; 0: any free one)")
    p.add_argument("--max-batch-size", type=integer(), default=8,
                   help="the most sequences decoding at once (default 8)")
    p.add_argument("--max-queue", type=integer(), default=64,
                   help="the most sequences waiting for a slot; beyond it requests get 429 (default 64)")
    p.add_argument("--prefix-cache-tokens", type=integer(0), default=4096,
                   help="positions of computed prompts kept for reuse by later prompts that start with them "
                        "(least recently used evicted; 0: off; default 4096)")
    p.add_argument("--chunked-prefill-size", type=integer(), default=256,
                   help="the most prompt tokens prefilled between two decoding steps: a longer prompt is prefilled "
                        "in chunks, so it delays the running answers by one chunk's time (default 256)")
    p.add_argument("--speculative", choices=["none", "lookup", "draft"], default="none",
                   help="lookup: every request's rows copy drafts from where their last tokens occurred before "
                        "(prompt lookup, LLMA); draft: a smaller --draft-model drafts them; either way verified "
                        "for all rows in the batch's steps: the same tokens, more of them per step when drafts "
                        "are taken (a request's prompt_lookup_num_tokens asks for lookup drafts whatever this says)")
    p.add_argument("--draft-model", help="the draft model for --speculative draft (the same tokenizer)")
    p.add_argument("--num-speculative-tokens", type=integer(), default=5,
                   help="the most tokens drafted per row and step (default 5)")
    add_model_arguments(p, compile_help=("decode through torch.compile over static caches (one compile per batch shape, cached "
                        "on disk; needs a C++ compiler, else runs uncompiled with a warning)"))
    p.add_argument("--api-key", default=os.environ.get("LLM_API_KEY"),
                   help="answer /v1 requests only with 'Authorization: Bearer API_KEY' (default: $LLM_API_KEY; "
                        "none: open to anyone who reaches the port)")
    p.add_argument("--shutdown-timeout", type=integer(0), default=10,
                   help="seconds that running requests may go on after Ctrl-C (or SIGTERM) before they end "
                        "with a 503 'shutting down' (a second Ctrl-C ends them at once; default 10)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info")
    return p


def graceful_server(config, shutdown, timeout: float):
    """A ``uvicorn.Server`` that stops as a server should: the first Ctrl-C (or SIGTERM) stops
    listening and lets running requests finish for ``timeout`` seconds, then calls ``shutdown()``
    (which ends them cleanly); a second Ctrl-C calls it at once. Never uvicorn's forced exit, which
    cancels the response tasks mid-write (CancelledError tracebacks) and leaves the engine's
    thread inside torch as the interpreter tears down ("terminate called")."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if self.should_exit:
                shutdown()
                return
            super().handle_exit(sig, frame)  # stop listening; uvicorn re-raises the signal when done
            timer = threading.Timer(timeout, shutdown)
            timer.daemon = True
            timer.start()

    return Server(config)


def loader(args):
    """The function that loads what ``args`` asks to serve (run by the server after it starts)."""

    def load():
        import torch

        from llm.generation.config import load_generation_config
        from llm.generation.config import GenerationConfig
        from llm.model import MosaicGPT
        from llm.serve.engine import Engine
        from llm.serve.http import Served

        tokenizer, model = load_model(args)
        # the model's sampling defaults, else OpenAI's (temperature 1, no truncation)
        defaults = load_generation_config(args.model) or GenerationConfig(do_sample=True, temperature=1.0)
        if defaults.eos_token_id is None and tokenizer.eos_token_id is not None:
            defaults = defaults.update(eos_token_id=tokenizer.eos_token_id)
        draft = None
        if args.speculative == "lookup":
            defaults = defaults.update(prompt_lookup_num_tokens=args.num_speculative_tokens, max_matching_ngram_size=3)
        elif args.speculative == "draft":
            draft = MosaicGPT.from_pretrained(args.draft_model, device=args.device, dtype=getattr(torch, args.dtype),
                                              quantization=args.quantize, backend=args.backend)
            defaults = defaults.update(num_assistant_tokens=args.num_speculative_tokens)
        engine = Engine(model, tokenizer, max_batch_size=args.max_batch_size, max_queue=args.max_queue,
                        prefix_cache_tokens=args.prefix_cache_tokens, compile=args.compile,
                        prefill_chunk=args.chunked_prefill_size, draft_model=draft).start()
        logging.getLogger("llm.serve").info("serving %s (%s parameters)", args.served_model_name or args.model,
                                            f"{model.num_parameters():,}")  # quantized weights are buffers
        return Served(engine, tokenizer, args.served_model_name or args.model, defaults, model.config.max_seq_len)

    return load


def main(argv: list[str] | None = None, prog: str = "serve.py") -> int:
    """Run the server until interrupted; returns the exit status (2 for bad flags or a --model that
    does not exist, 1 if it cannot listen or the model fails to load)."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if model_problem(args.model):
        parser.error(model_problem(args.model))
    if args.speculative == "draft" and args.draft_model is None:
        parser.error("--speculative draft needs --draft-model (a smaller model with the same tokenizer)")
    if args.draft_model is not None and args.speculative != "draft":
        parser.error(f"--draft-model drafts only with --speculative draft (got --speculative {args.speculative})")
    if args.draft_model is not None and model_problem(args.draft_model):
        parser.error("--draft-model " + model_problem(args.draft_model))
    # Listen before anything starts, so that a taken port or an unknown host is one line here.
    try:
        family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
        listening = socket.create_server((args.host, args.port), family=family)
    except OSError as err:  # gaierror for a host that does not resolve
        print(f"{prog}: error: cannot listen on {args.host}:{args.port}: {err.strerror or err}", file=sys.stderr)
        return 1
    import uvicorn

    from llm.serve.http import create_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    failures, server = [], None

    def failed(message: str) -> None:  # a server without its model serves nothing: stop it
        failures.append(message)
        server.should_exit = True

    app = create_app(loader(args), on_failure=failed, api_key=args.api_key)
    server = graceful_server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level),
                             app.state.shutdown, args.shutdown_timeout)
    host, port = listening.getsockname()[:2]
    logging.getLogger("llm.serve").info("listening on http://%s:%d (Ctrl+C to stop)",
                                        f"[{host}]" if ":" in host else host, port)
    try:
        server.run(sockets=[listening])
    except KeyboardInterrupt:  # uvicorn shuts down on Ctrl-C, then raises it again: a requested stop
        pass
    if failures:
        print(f"{prog}: error: loading {args.model} failed: {failures[0]}", file=sys.stderr)
        return 1
    if any(t.name == "llm-loader" and t.is_alive() for t in threading.enumerate()):
        # Stopped while the model loads: the interpreter's teardown under a thread inside torch
        # aborts the process ("terminate called without an active exception"), so leave now.
        print(f"{prog}: stopped while the model was loading", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
