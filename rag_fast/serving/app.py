"""The HTTP front of ``rag-fast serve``: a Starlette app over a :class:`Batcher`.

Routes (JSON in and out; docs/serving.md has the shapes):

- ``POST /v1/answer`` ``{"question": str | [str], "n_docs", "num_beams", "max_new_tokens",
  "mode"}`` -> ``{"answers": [record], "index": checksum}``
- ``POST /v1/retrieve`` ``{"question", "n_docs"}`` -> ``{"results": [...], "index": ...}``
- ``GET /v1/health``: 200 ``{"status": "ready", ...}`` while the worker runs, else 503
- ``GET /metrics``: Prometheus text (``prometheus_client``)
- ``GET /openapi.json``: the OpenAPI description, made from the same field table that checks
  the requests
- ``POST /v1/admin/index`` ``{"path": DIR}``: swap the index (with the admin token only)

Every error is one JSON line ``{"error": "..."}``: 400 malformed JSON, 413 a body over
``max_body`` bytes, 422 unknown fields, wrong types or values past the limits, 503 a full queue
(with ``Retry-After``), 504 a request past its timeout, 500 an unexpected error (its message
goes to the server's log, never a traceback on the wire).
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from typing import TYPE_CHECKING

from rag_fast.serving.answerer import MODES, Answerer
from rag_fast.serving.batcher import Batcher, Overloaded, Stopped

if TYPE_CHECKING:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response

MAX_BODY = 1 << 20  # bytes of a request body


class _Refused(Exception):
    """A request refused with ``status`` and a one-line ``message``."""

    def __init__(self, status: int, message: str, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers


# The fields each route takes: (JSON type, description). Checks and the OpenAPI document
# are both made from this table.
_QUESTION = ("question", "string or array", "a question, or a list of questions")
FIELDS = {
    "answer": {
        "question": _QUESTION[1:],
        "n_docs": ("integer", "passages retrieved and marginalised over per question "
                              "(default: the model's)"),
        "num_beams": ("integer", "beams (default 4; 1: greedy)"),
        "max_new_tokens": ("integer", "longest answer in tokens (default 32)"),
        "mode": ("string", "RAG mode, 'token' or 'sequence' (default: the model's)"),
    },
    "retrieve": {
        "question": _QUESTION[1:],
        "n_docs": ("integer", "passages per question (default: the model's n_docs)"),
    },
    "admin_index": {
        "path": ("string", "an index directory under the server's --index-root"),
    },
}


def _check_fields(body: Any, route: str) -> dict:
    """The body as a dict with only known fields of the right JSON types (422 otherwise)."""
    if not isinstance(body, dict):
        raise _Refused(422, f"the body must be a JSON object, got {type(body).__name__}")
    known = FIELDS[route]
    unknown = sorted(set(body) - set(known))
    if unknown:
        raise _Refused(422, f"unknown field {unknown[0][:60]!r} (known: {', '.join(known)})")
    for name, value in body.items():
        kind = known[name][0]
        if kind == "integer" and (isinstance(value, bool) or not isinstance(value, int)):
            raise _Refused(422, f"{name} must be an integer, got {_json_type(value)}")
        if kind == "string" and not isinstance(value, str):
            raise _Refused(422, f"{name} must be a string, got {_json_type(value)}")
        if kind == "string or array" and not isinstance(value, (str, list)):
            raise _Refused(422, f"{name} must be a string or an array of strings, got "
                                f"{_json_type(value)}")
    if "question" in known and "question" not in body:
        raise _Refused(422, "question is required")
    return body


def _json_type(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "an array", dict: "an object", type(None): "null"}.get(type(value), "a value")


def openapi(answerer: Answerer, max_queue: int | None = None) -> dict:
    """The OpenAPI 3.1 description of the routes, with this server's limits (a request holds at
    most ``max_queue`` questions, the most the queue can take)."""
    lim = answerer.limits
    per_request = lim.max_questions if max_queue is None else min(lim.max_questions, max_queue)
    bounds = {"n_docs": lim.max_n_docs, "num_beams": lim.max_beams,
              "max_new_tokens": lim.max_new_tokens}

    def schema(route: str) -> dict:
        props = {}
        for name, (kind, text) in FIELDS[route].items():
            if kind == "string or array":
                prop = {"oneOf": [{"type": "string", "maxLength": lim.max_question_chars},
                                  {"type": "array", "maxItems": per_request,
                                   "items": {"type": "string",
                                             "maxLength": lim.max_question_chars}}]}
            elif kind == "integer":
                prop = {"type": "integer", "minimum": 1, "maximum": bounds[name]}
            elif name == "mode":
                prop = {"type": "string", "enum": list(MODES)}
            else:
                prop = {"type": kind}
            props[name] = {**prop, "description": text}
        required = ["question"] if "question" in props else list(props)
        return {"type": "object", "properties": props, "required": required,
                "additionalProperties": False}

    error = {"description": "an error", "content": {"application/json": {"schema": {
        "type": "object", "properties": {"error": {"type": "string"}}}}}}
    errors = {"400": error, "413": error, "422": error, "503": error, "504": error}

    def post(route: str, summary: str) -> dict:
        return {"post": {"summary": summary, "requestBody": {"required": True, "content": {
            "application/json": {"schema": schema(route)}}},
            "responses": {"200": {"description": "the result"}, **errors}}}

    return {
        "openapi": "3.1.0",
        "info": {"title": "rag-fast serve", "version": "1"},
        "paths": {
            "/v1/answer": post("answer", "answer questions, with the passages used"),
            "/v1/retrieve": post("retrieve", "retrieve passages only"),
            "/v1/admin/index": post("admin_index", "swap the index (Authorization: Bearer "
                                                   "TOKEN)"),
            "/v1/health": {"get": {"summary": "200 once ready, 503 otherwise",
                                   "responses": {"200": {"description": "ready"}}}},
            "/metrics": {"get": {"summary": "Prometheus metrics",
                                 "responses": {"200": {"description": "text format"}}}},
        },
    }


class _Metrics:
    """The server's Prometheus metrics, in a registry of its own."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("rag_fast_requests", "requests answered, by route and outcome",
                                ["route", "outcome"], registry=r)
        self.batch = Histogram("rag_fast_batch_questions", "questions per batch",
                               buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        self.batch_requests = Histogram("rag_fast_batch_requests", "requests per batch",
                                        buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.queue = Gauge("rag_fast_queue_questions", "questions waiting for a batch",
                           registry=r)
        self.stage = Histogram("rag_fast_stage_seconds", "time per stage of a batch",
                               ["stage"], registry=r)
        self.latency = Histogram("rag_fast_request_seconds", "time per request, by route",
                                 ["route"], registry=r)
        self.swaps = Counter("rag_fast_index_swaps", "index swaps, by outcome", ["outcome"],
                             registry=r)


def create_app(answerer: Answerer, *, max_wait_ms: float = 5.0, max_queue: int = 1024,
               timeout_s: float = 60.0, admin_token: str | None = None,
               index_root: str | None = None, max_body: int = MAX_BODY) -> Starlette:
    """The Starlette app serving ``answerer`` (see the module docstring). Its lifespan starts
    the batching worker and stops it after the requests in flight are answered.

    Args:
        max_wait_ms, max_queue: the batcher's (:class:`Batcher`); ``answerer.max_batch``
            questions per batch.
        timeout_s: a request not answered by then gets 504 (dropped if its batch has not
            started).
        admin_token: the token of ``/v1/admin/*`` (``Authorization: Bearer TOKEN``); None
            turns those routes off.
        index_root: the folder the admin routes may load indexes from (needed with a token).
    """
    # deferred: the ASGI stack loads only where a server runs (not in every rag-fast command)
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    if admin_token is not None and not index_root:
        raise ValueError("an admin token needs index_root (the folder swapped indexes lie in)")
    metrics = _Metrics()
    batcher = Batcher(answerer, max_batch=answerer.max_batch, max_wait_ms=max_wait_ms,
                      max_queue=max_queue, on_batch=lambda q, j: (metrics.batch.observe(q),
                                                                  metrics.batch_requests.observe(j)),
                      on_stage=lambda s, t: metrics.stage.labels(s).observe(t))
    metrics.queue.set_function(lambda: batcher.queued)
    root = os.path.realpath(index_root) if index_root else None
    token = admin_token.encode() if admin_token is not None else None
    spec = openapi(answerer, max_queue)

    async def read_json(request: Request) -> Any:
        size = request.headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > max_body):
            raise _Refused(413, f"the body is over {max_body} bytes")
        chunks, total = [], 0
        try:
            async for chunk in request.stream():
                total += len(chunk)
                if total > max_body:
                    raise _Refused(413, f"the body is over {max_body} bytes")
                chunks.append(chunk)
        except ClientDisconnect:
            raise _Refused(499, "the client went away while sending its body") from None
        try:
            return json.loads(b"".join(chunks), parse_constant=_no_constant)
        except (ValueError, RecursionError) as e:
            raise _Refused(400, f"malformed JSON: {str(e)[:120]}") from None

    async def wait_batch(request: Request, job) -> list[dict]:
        """The job's records; None when the client went away first."""
        result = asyncio.wrap_future(job.future)
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({result, gone}, timeout=timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if result in done:
            return result.result()
        job.future.cancel()  # dropped unless its batch has started
        if gone in done:
            raise _Refused(499, "the client went away")
        raise _Refused(504, f"not answered within the server's timeout of {timeout_s:g} s")

    async def answer_route(request: Request, route: str) -> Response:
        body = _check_fields(await read_json(request), route)
        try:
            questions = answerer.check_questions(body["question"])
            if len(questions) > max_queue:  # could never be queued: not a "retry later"
                raise ValueError(f"question: at most {max_queue} questions per request (the "
                                 f"server's queue, --max-queue), got {len(questions)}")
            if route == "answer":
                settings = answerer.settings(n_docs=body.get("n_docs"),
                                             num_beams=body.get("num_beams"),
                                             max_new_tokens=body.get("max_new_tokens"),
                                             mode=body.get("mode"))
            else:
                settings = answerer.settings(n_docs=body.get("n_docs"))
        except ValueError as e:
            raise _Refused(422, str(e)) from None
        try:
            job = batcher.submit(questions, settings, decode=route == "answer")
        except Overloaded as e:
            raise _Refused(503, f"busy: {e}; retry later", {"Retry-After": "1"}) from None
        except Stopped:
            raise _Refused(503, "the server is stopping", {"Retry-After": "5"}) from None
        try:
            records = await wait_batch(request, job)
        except ValueError as e:  # of the batch (e.g. n_docs past a smaller swapped index)
            raise _Refused(422, str(e)) from None
        index = records[0]["index"]
        key = "answers" if route == "answer" else "results"
        return JSONResponse({key: records, "index": index})

    def endpoint(route: str):
        async def handle(request: Request) -> Response:
            start = time.perf_counter()
            outcome = "ok"
            try:
                if route in ("answer", "retrieve"):
                    return await answer_route(request, route)
                return await admin_index(request)
            except _Refused as e:
                outcome = str(e.status)
                return JSONResponse({"error": e.message}, status_code=e.status,
                                    headers=e.headers)
            except Exception as e:  # noqa: BLE001  (a one-line error; the log has the type)
                outcome = "500"
                print(f"rag-fast serve: error in {route}: {type(e).__name__}: "
                      f"{str(e)[:300]}", file=sys.stderr, flush=True)
                return JSONResponse({"error": f"internal error ({type(e).__name__})"},
                                    status_code=500)
            finally:
                metrics.requests.labels(route, outcome).inc()
                metrics.latency.labels(route).observe(time.perf_counter() - start)
        return handle

    async def admin_index(request: Request) -> Response:
        if token is None:
            raise _Refused(403, "admin routes are off: start the server with --admin-token-file")
        given = request.headers.get("authorization", "")
        scheme, _, value = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), token):
            raise _Refused(401, "a valid 'Authorization: Bearer TOKEN' header is needed")
        body = _check_fields(await read_json(request), "admin_index")
        if "path" not in body:
            raise _Refused(422, "path is required")
        path = body["path"]
        if not path or "\x00" in path or len(path) > 4096:
            raise _Refused(422, "path must be a non-empty folder path (at most 4096 characters, "
                                "no NUL)")
        real = os.path.realpath(path)
        if os.path.commonpath([real, root]) != root:
            raise _Refused(422, f"path {path[:200]!r} is not under the server's --index-root")
        old = answerer.index.checksum
        try:
            new = await asyncio.get_running_loop().run_in_executor(None, answerer.swap_index,
                                                                   real)
        except RuntimeError as e:
            metrics.swaps.labels("busy").inc()
            raise _Refused(409, str(e)) from None
        except (OSError, ValueError) as e:  # StorageError is a ValueError
            metrics.swaps.labels("failed").inc()
            raise _Refused(422, f"index not swapped, {old[:12]} still serving: "
                                f"{str(e)[:300]}") from None
        metrics.swaps.labels("ok").inc()
        return JSONResponse({"index": new.checksum, "previous": old, "path": path,
                             "passages": new.size})

    async def health(request: Request) -> Response:
        ready = batcher.running
        return JSONResponse({"status": "ready" if ready else "stopping",
                             **answerer.describe(), "queued": batcher.queued},
                            status_code=200 if ready else 503)

    async def metrics_route(request: Request) -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def openapi_route(request: Request) -> Response:
        return JSONResponse(spec)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code)

    async def server_error(request: Request, exc: Exception) -> Response:
        return JSONResponse({"error": f"internal error ({type(exc).__name__})"}, status_code=500)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        batcher.start()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, batcher.stop)

    app = Starlette(routes=[
        Route("/v1/answer", endpoint("answer"), methods=["POST"]),
        Route("/v1/retrieve", endpoint("retrieve"), methods=["POST"]),
        Route("/v1/admin/index", endpoint("admin_index"), methods=["POST"]),
        Route("/v1/health", health, methods=["GET"]),
        Route("/metrics", metrics_route, methods=["GET"]),
        Route("/openapi.json", openapi_route, methods=["GET"]),
    ], exception_handlers={HTTPException: http_error, Exception: server_error},
        lifespan=lifespan)
    app.state.batcher, app.state.answerer, app.state.metrics = batcher, answerer, metrics
    return app


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


async def _disconnected(request: Request) -> None:
    """Return once the client has gone away (the body is read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def read_token_file(path: str | Path) -> str:
    """The admin token in ``path`` (its first line, stripped; at least 16 characters).

    Raises:
        ValueError: naming ``--admin-token-file``: missing, unreadable, empty or short.
    """
    import stat

    try:  # a pipe would block the start, a device give endless bytes: a regular file only
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise ValueError(f"--admin-token-file {str(path)!r}: not a regular file (a folder, "
                             "a device or a pipe); give a file holding the token")
        with open(path, encoding="utf-8") as f:
            text = f.read(4096)
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--admin-token-file {str(path)!r}: cannot read it "
                         f"({getattr(e, 'strerror', None) or type(e).__name__})") from None
    lines = text.splitlines()
    token = lines[0].strip() if lines else ""
    if len(token) < 16 or not all(33 <= ord(c) < 127 for c in token):
        raise ValueError(f"--admin-token-file {str(path)!r}: the token on its first line must "
                         "have at least 16 characters, printable ASCII without spaces (it is "
                         "sent in a header)")
    return token


__all__ = ["FIELDS", "MAX_BODY", "create_app", "openapi", "read_token_file"]
