"""``rag-fast serve``: a trained model answering over HTTP, in batches, its index swappable.

    rag-fast serve --model DIR [--index DIR] [--host 127.0.0.1] [--port 8000]
                   [--max-batch 16] [--max-wait-ms 5] [--admin-token-file F --index-root DIR]

The model and index load before the port opens (a bad model or index is the usual one-line
error, exit 2); then one line says where it listens. SIGTERM (or Ctrl-C) stops taking
connections, answers the requests in flight, and exits 0 (130 for Ctrl-C) with one line; a
second signal exits at once. docs/serving.md describes the routes.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading

from rag_fast import _interrupt
from rag_fast._validation import not_a_folder
from rag_fast.cli.common import check_positive
from rag_fast.serving.answerer import Answerer, Limits
from rag_fast.serving.app import create_app, read_token_file


def check_args(args) -> str | None:
    """Every option checked before anything loads; returns the admin token (or None)."""
    check_positive(("--max-batch", args.max_batch), ("--max-queue", args.max_queue),
                   ("--max-n-docs", args.max_n_docs), ("--max-beams", args.max_beams),
                   ("--max-new-tokens", args.max_new_tokens))
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if not 0 <= args.max_wait_ms <= 60_000:
        raise ValueError(f"--max-wait-ms must be in [0, 60000], got {args.max_wait_ms}")
    if not 0 < args.timeout <= 86_400:
        raise ValueError(f"--timeout must be in (0, 86400] seconds, got {args.timeout}")
    for flag, value, bound in (("--max-batch", args.max_batch, 4096),
                               ("--max-queue", args.max_queue, 1_000_000),
                               ("--max-n-docs", args.max_n_docs, 1024),
                               ("--max-beams", args.max_beams, 64),
                               ("--max-new-tokens", args.max_new_tokens, 4096)):
        if value > bound:
            raise ValueError(f"{flag} must be at most {bound}, got {value}")
    if args.admin_token_file is None:
        if args.index_root is not None:
            raise ValueError("--index-root is for the admin routes: give --admin-token-file too")
        return None
    if args.index_root is None:
        raise ValueError("--admin-token-file needs --index-root DIR (the folder whose indexes "
                         "the admin routes may load)")
    if not os.path.isdir(args.index_root):
        raise ValueError(f"--index-root {args.index_root}: {not_a_folder(args.index_root)}")
    return read_token_file(args.admin_token_file)


class _StoppedStarting(BaseException):
    """SIGTERM before the server took its signals (a BaseException: no ``except Exception`` of
    the loaders turns it into another error)."""


def _stop_starting(signum, frame) -> None:
    raise _StoppedStarting


def run(args) -> int:
    # a Ctrl-C before it serves (uvicorn's handling then takes over): serve writes no output
    args.on_interrupt = lambda: "the server stopped before it was ready (it writes nothing)"
    token = check_args(args)
    import uvicorn  # deferred: only this command serves (not every rag-fast command's start-up)

    # SIGTERM while the model and index load: stop with one line (uvicorn's own handling, which
    # drains the requests in flight, takes over once it serves)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _stop_starting) if main_thread else None
    try:
        limits = Limits(max_n_docs=args.max_n_docs, max_beams=args.max_beams,
                        max_new_tokens=args.max_new_tokens)
        answerer = Answerer.load(args.model, args.index, device=args.device,
                                 max_batch=args.max_batch, limits=limits,
                                 retrieval_mode=args.retrieval_mode)
        app = create_app(answerer, max_wait_ms=args.max_wait_ms, max_queue=args.max_queue,
                         timeout_s=args.timeout, admin_token=token, index_root=args.index_root)
        _uvicorn_logging()
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                log_config=None,  # set above, without logging.config
                                access_log=args.log_requests, lifespan="on",
                                # connections past the queue's questions get uvicorn's 503
                                limit_concurrency=args.max_queue + 64,
                                timeout_graceful_shutdown=args.timeout + 5, workers=1)
        if args.log_requests:  # (uvicorn's log_level set the request lines' logger too)
            logging.getLogger("uvicorn.access").setLevel(logging.INFO)
        sock = _listen(args.host, args.port)
    except _StoppedStarting:
        print("rag-fast serve: SIGTERM before the server was ready: stopped (nothing was "
              "answered, nothing written)", file=sys.stderr)
        return 0
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    server = _server_class()(config)
    server.model_dir, server.index = args.model, answerer.index
    server.run(sockets=[sock])
    done = f"{server.signal_name}: answered the requests in flight and stopped"
    if server.signal_name == "SIGINT":
        _interrupt.say_last(f"rag-fast: interrupted; {done}")
        return 130
    print(f"rag-fast serve: {done}", file=sys.stderr)
    return 0


def _uvicorn_logging() -> None:
    """uvicorn's loggers as its default logging config sets them (messages on standard error,
    request lines on standard output), without ``logging.config.dictConfig``: that closes every
    handler the process has first, other libraries' included, and one whose stream is a
    caller's (absl's, holding the standard error of when it was imported) closes that stream.
    A second call replaces the handlers it added (``main()`` in a process that goes on)."""
    from uvicorn.logging import AccessFormatter, DefaultFormatter  # deferred: as uvicorn

    for name, stream, formatter in (
            ("uvicorn", sys.stderr, DefaultFormatter("%(levelprefix)s %(message)s")),
            ("uvicorn.access", sys.stdout, AccessFormatter(
                '%(levelprefix)s %(client_addr)s - "%(request_line)s" %(status_code)s'))):
        handler = _LogLines(stream)
        handler.setFormatter(formatter)
        logger = logging.getLogger(name)
        logger.handlers, logger.propagate = [handler], False
        logger.setLevel(logging.INFO)


class _LogLines(logging.StreamHandler):
    """A stream handler that stops at its stream's first failure (a closed pipe, a full disk)
    with one warning line, where logging's own would print a traceback for every record."""

    failed = False

    def handleError(self, record) -> None:  # noqa: N802  (logging's name)
        if not self.failed:
            self.failed = True
            error = sys.exc_info()[1]
            where = "standard output" if self.stream is sys.stdout else "its stream"
            with contextlib.suppress(Exception):
                print(f"rag-fast serve: warning: writing log lines to {where} failed "
                      f"({error.strerror if isinstance(error, OSError) else error}); no more "
                      "are written", file=sys.stderr, flush=True)

    def emit(self, record) -> None:
        if not self.failed:
            super().emit(record)


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``, or one line naming ``--host``/``--port``."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"--host {host[:200]!r}: not an address of this machine "
                         f"({getattr(e, 'strerror', None) or e})") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise ValueError(f"--host {host} --port {port}: cannot listen there "
                         f"({e.strerror or e})") from None
    return sock


def _server_class():
    """uvicorn's ``Server`` with this command's signals and start-up line (a class made on first
    use: uvicorn is imported only by this command)."""
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server with this command's signals: the first SIGTERM or SIGINT drains
        (stop accepting, answer what is in flight), a second exits at once; the port and
        failures are said in one line each."""

        signal_name = "SIGTERM"
        model_dir = ""
        index = None

        @contextlib.contextmanager
        def capture_signals(self):
            def on_signal(signum, frame):
                if self.should_exit:
                    os.write(2, f"rag-fast serve: second {signal.Signals(signum).name}: exiting "
                                "now, requests in flight are dropped\n".encode())
                    os._exit(128 + signum)
                self.signal_name = signal.Signals(signum).name
                self.should_exit = True

            saved = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, handler in saved.items():
                    signal.signal(s, handler)

        async def startup(self, sockets=None):
            await super().startup(sockets)
            host, port = sockets[0].getsockname()[:2]
            print(f"rag-fast serve: {self.model_dir} answering from index "
                  f"{self.index.checksum[:12]} ({self.index.size} passages) on "
                  f"http://{host}:{port} (SIGTERM or Ctrl-C stops)", file=sys.stderr, flush=True)

    return Server
