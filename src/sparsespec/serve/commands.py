"""``sparsespec serve`` and ``sparsespec chat``: their flags, and loading the engine they share."""

from __future__ import annotations

import argparse
import sys
import threading
import time

from ..errors import UserError
from ..ngram import DEFAULT_SHARED_TOKENS, MAX_SHARED_TOKENS
from .guard import API_KEY_ENV


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Model, cache and draft flags, as ``sparsespec generate`` has them."""
    from ..flags import add_cache_arguments, add_draft_arguments, add_model_arguments

    add_model_arguments(parser)
    add_cache_arguments(parser)
    add_draft_arguments(parser)


def engine_options(args: argparse.Namespace):
    """``(cache, draft settings or None)`` from the flags, checked before anything is loaded."""
    from ..flags import cache_options, check_draft_flags, draft_settings

    cache = cache_options(args)
    check_draft_flags(args)
    return cache, draft_settings(args)


def load_engine(args: argparse.Namespace, options):
    """Load the target (and draft) named by the flags: ``(target, cache, draft options or None)``."""
    from ..flags import load_draft, setup_torch
    from ..cache.arena import require_kernels
    from ..loading.load import load_model

    cache, draft_setup = options
    dtype = setup_torch(args)
    require_kernels()  # before the minutes a load may take: nothing decodes without them
    target = load_model(args.model, dtype, args.weights, role="target", activations=args.activations)
    return target, cache, load_draft(args, target, dtype, draft_setup)


# ----------------------------------------------------------------------------------------------------- serve
# Requests decoded together by default: four chats at once multiply the aggregate speed while each first text comes
# about as soon as one chat's; eight gain more but make each first text wait:
# benchmarks/history/serving-and-footprint.md#several-users-at-once-batched-serving-against-llama-server-2026-12-05
DEFAULT_PARALLEL = 4
# Prompt rows per pass in serve (generate and chat read 512): a prompt joining the others is read in chunks, each in
# a pass with their decode rows, so the chunk is how long they wait between two tokens. Smaller chunks keep a
# running chat's text coming several times as often while a long prompt joins, and the prompt takes as long to read
# (bench_serve.py --modes join):
# benchmarks/history/serving-and-footprint.md#several-users-at-once-batched-serving-against-llama-server-2026-12-05
SERVE_PREFILL_CHUNK = 128


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.set_defaults(prefill_chunk=SERVE_PREFILL_CHUNK)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8080, help="port to listen on (default: %(default)s)")
    parser.add_argument("--parallel", "-np", type=int, default=DEFAULT_PARALLEL,
                        help="requests decoded at once, each in its own cache slot (default: %(default)s)")
    parser.add_argument("--queue-size", type=int, default=16,
                        help="requests that may wait for the engine; more get 503 (default: %(default)s)")
    parser.add_argument("--no-evict-overflow", action="store_true",
                        help="with a budget and in-cache positions, answer 400 to a request that would run past "
                        "the model's context instead of evicting")
    parser.add_argument("--max-prompt-tokens", type=int, default=None, metavar="N",
                        help="the longest prompt taken, in tokens (default: the model's context, or 2^20 where a "
                        "budget with in-cache positions lets a conversation outgrow it)")
    parser.add_argument("--ngram-shared-tokens", type=int, default=None, metavar="N",
                        help="tokens of finished requests that greedy n-gram drafting also matches, per cache_salt "
                             f"(0: each conversation drafts from its own text only; default: {DEFAULT_SHARED_TOKENS})")
    parser.add_argument("--max-body-bytes", default="8MiB", metavar="SIZE",
                        help="the largest request body read, in bytes or with a KiB / MiB suffix (default: "
                        "%(default)s)")
    parser.add_argument("--api-key", default=None, metavar="KEY",
                        help=f"answer only requests that send 'Authorization: Bearer KEY' (all but /health); "
                        f"default: ${API_KEY_ENV}, else none. The environment keeps the key out of process lists")
    parser.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                        help="also accept requests whose Host header names NAME (repeatable; '*' accepts any). By "
                        "default only the address listened on, localhost and, on 0.0.0.0, IP addresses: web pages "
                        "cannot reach the server through a name of theirs (DNS rebinding)")
    parser.add_argument("--cors", action="append", default=[], metavar="ORIGIN",
                        help="let web pages at ORIGIN (e.g. http://localhost:3000; '*' for any) call the server "
                        "and read its answers (repeatable); without it requests from web pages are refused")


def check_shared_ngram_tokens(given: int | None, draft_setup) -> int:
    """``--ngram-shared-tokens`` checked against its range and the draft settings (``flags.draft_settings``: a
    tuple whose last item is the n-gram options, or None); the default where not given."""
    if given is None:
        return DEFAULT_SHARED_TOKENS
    if not 0 <= given <= MAX_SHARED_TOKENS:
        raise UserError(f"--ngram-shared-tokens must be from 0 to {MAX_SHARED_TOKENS} (got {given}).")
    if given and (draft_setup is None or draft_setup[-1] is None):
        raise UserError("--ngram-shared-tokens does nothing without n-gram drafting (--draft ngram, or a draft "
                        "model with --draft-ngram on).")
    return given


def run_serve(args: argparse.Namespace) -> int:
    """Serve the model over HTTP until interrupted."""
    from ..flags import NGRAM_DRAFT, prefetch_models

    prefetch_models(args)  # first: the stored weights are mapped (and start moving into huge pages) while torch imports
    import uvicorn

    from ..loading.source import resolve_model
    from ..flags import parse_size
    from .guard import access_from_environment
    from .server import ServerState, create_app
    from .worker import EngineWorker, check_worker_options

    options = engine_options(args)
    check_worker_options(options[0], args.queue_size, args.no_evict_overflow, args.parallel, args.max_prompt_tokens)
    if not 0 <= args.port < 65536:
        raise UserError(f"--port must be from 0 to 65535 (got {args.port}).")
    shared_ngram_tokens = check_shared_ngram_tokens(args.ngram_shared_tokens, options[1])
    max_body = parse_size(args.max_body_bytes, "--max-body-bytes")
    if max_body < 1024:
        raise UserError(f"--max-body-bytes must be at least 1 KiB (got {max_body} bytes).")
    if args.api_key is not None and not args.api_key.strip():
        raise UserError("--api-key is empty; give a key, or drop the flag to serve without one.")
    access = access_from_environment(args.host, args.allow_host, args.cors, args.api_key, max_body)
    _check_port_free(args.host, args.port)  # before the model loads, not a minute after
    resolve_model(args.model)  # a wrong name fails now, not after the port is open
    if args.draft not in (None, "self", NGRAM_DRAFT):  # a draft model's name
        resolve_model(args.draft)

    def load() -> EngineWorker:
        target, cache, draft = load_engine(args, options)
        print(f"sparsespec: {target.name} loaded; serving.", file=sys.stderr, flush=True)
        return EngineWorker(target, cache, draft, parallel=args.parallel, queue_size=args.queue_size,
                            no_evict_overflow=args.no_evict_overflow, max_prompt_tokens=args.max_prompt_tokens,
                            shared_ngram_tokens=shared_ngram_tokens)

    # The engine takes this (the main) thread, the HTTP server a thread beside it (see ServerState).
    state = ServerState(load, background=False)
    server = uvicorn.Server(uvicorn.Config(create_app(state, access), host=args.host, port=args.port,
                                           log_level="warning"))
    http = threading.Thread(target=server.run, name="sparsespec-http", daemon=True)
    state.on_failure = lambda exc: setattr(server, "should_exit", True)
    print(f"sparsespec: loading {args.model}; the API will be at http://{args.host}:{args.port}/v1 "
          "(GET /health answers 503 until then)", file=sys.stderr, flush=True)
    http.start()
    # The HTTP server's own shutdown (Ctrl-C, or a port it could not bind) stops the engine's loop.
    watcher = threading.Thread(target=_stop_engine_after, args=(http, state), name="sparsespec-watch", daemon=True)
    watcher.start()
    interrupted = False
    try:
        state.run_engine()
    except KeyboardInterrupt:
        interrupted = True
    finally:
        server.should_exit = True
        http.join(timeout=30)
        if state.worker is not None:
            state.worker.stop()
    if state.error is not None:
        raise state.error
    if not interrupted and not server.started:
        raise UserError(f"Could not listen on {args.host}:{args.port} (is the port in use?).")
    return 0


def _check_port_free(host: str, port: int) -> None:
    """Raise :class:`UserError` if ``host:port`` cannot be bound now (taken, or not an address of this machine)."""
    import socket

    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            probe.bind((host, port))
    except OSError as exc:
        raise UserError(f"Could not listen on {host}:{port} ({exc.strerror or exc}).") from None


def _stop_engine_after(http: threading.Thread, state) -> None:
    """Stop the engine's loop once the HTTP server's thread has ended."""
    http.join()
    while state.worker is None and state.error is None:  # still loading: stop as soon as it is ready
        time.sleep(0.1)
    if state.worker is not None:
        state.worker.stop()


# ------------------------------------------------------------------------------------------------------ chat
def add_chat_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--max-new-tokens", "-n", type=int, default=512, help="longest answer (default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)


def run_chat(args: argparse.Namespace) -> int:
    """An interactive chat in the terminal."""
    from ..flags import prefetch_models

    prefetch_models(args)  # first: the stored weights are mapped (and start moving into huge pages) while torch imports
    from ..engine import Session
    from ..sampling import SamplingParams
    from .chat import Chat

    options = engine_options(args)
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p)
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1 (got {args.max_new_tokens}).")
    target, cache, draft = load_engine(args, options)
    session = Session(target, cache, draft, capacity=target.config.max_position_embeddings)
    chat = Chat(session, sampling=sampling, max_new_tokens=args.max_new_tokens, seed=args.seed)
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    return chat.loop()
