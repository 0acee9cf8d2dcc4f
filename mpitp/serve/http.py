"""The OpenAI-compatible HTTP side, on rank 0: FastAPI on uvicorn, as vLLM's server
(the loop every rank runs: scheduler.py; what a request holds: requests.py).

    POST /v1/chat/completions   messages -> the model's chat template -> completion
    POST /v1/completions        prompt (text or token ids) -> completion
         stream: true           server-sent events ("data: {...}" ... "data: [DONE]")
    GET  /v1/models, /health, /metrics (Prometheus)

uvicorn runs in a thread of rank 0 (its own event loop; the main thread keeps the
signals and runs the lockstep loop). A request is validated (400 with OpenAI's error
body), its ``n`` choices queued for the loop (503 when the bounded queue is full), and the
events the loop sends back — ``(choice, kind, text, records)`` with kind "echo", "delta"
or "done" — reach an asyncio queue through the event loop's thread-safe door. A client
that goes away cancels its choices; the loop frees their rows at the next step.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from ..models import chat
from . import logprobs as lp
from . import metrics, tools
from .requests import BadRequest, Service
from .requests import Request as Choice


class Events:
    """A request's event queue: ``put`` from the loop's thread, ``get`` on uvicorn's loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.q: asyncio.Queue = asyncio.Queue()

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.q.put_nowait, item)

    async def get(self, timeout: float):
        return await asyncio.wait_for(self.q.get(), timeout)


def error(code: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": code}}, status_code=code)


def make_app(service: Service) -> FastAPI:
    app = FastAPI(title="mpitp", docs_url=None, redoc_url=None, openapi_url=None)
    fmt = lp.Formatter(service.tok)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):  # 404, 405 in OpenAI's shape
        return error(e.status_code, f"{e.detail}: {request.method} {request.url.path}")

    def refused(request: Request) -> JSONResponse | None:
        if service.api_key and request.headers.get("authorization") != f"Bearer {service.api_key}":
            return error(401, "missing or wrong API key", "authentication_error")
        return None

    @app.get("/health")
    def health():
        return {"status": "ok"}

    @app.get("/metrics")  # unauthenticated, as vLLM's: scrapers carry no key
    def prometheus():
        return Response(service.metrics.text(), media_type=metrics.CONTENT_TYPE)

    @app.get("/v1/models")
    def models(request: Request):
        return refused(request) or {
            "object": "list",
            "data": [{"id": service.name, "object": "model", "owned_by": "mpitp"}],
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await submit(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await submit(request, "text")

    async def submit(request: Request, kind: str):
        if (no := refused(request)) is not None:
            return no
        try:
            body = json.loads(await request.body() or b"null")
            rs = await run_in_threadpool(service.make, body, kind, Events(asyncio.get_running_loop()))
        except (ValueError, BadRequest, chat.ChatTemplateError) as e:
            return error(400, str(e))
        if service.stopping.is_set():
            return error(503, "the server is shutting down", "server_error")
        for i, r in enumerate(rs):
            try:
                service.inbox.put_nowait(r)
            except queue.Full:
                for q in rs[:i]:
                    q.cancelled = True  # the choices already queued never run
                return error(503, "too many requests queued; try again", "server_error")
        if rs[0].stream:
            return StreamingResponse(stream(rs), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return JSONResponse(await whole(rs))

    # ------------------------------------------------------------------ bodies
    def logprobs(r: Choice, records: list, ids: list[int] | None = None):
        """The choice's ``logprobs`` for these token records (None unless asked); text
        completions count ``text_offset`` on from ``r.offset``."""
        if r.job.logprobs is None:
            return None
        if r.kind == "chat":
            return {"content": fmt.chat(records)}
        ids = [rec[0] for rec in records] if ids is None else ids
        out = fmt.completion(records, ids, r.offset)
        r.offset += sum(len(t) for t in out["tokens"])
        return out

    def envelope(r: Choice, obj: str, choices: list, **extra) -> dict:
        head = {"id": f"cmpl-{r.job.id}", "object": obj, "created": r.created, "model": service.name}
        return {**head, "choices": choices, **extra}

    def usage(rs: list[Choice]) -> dict:
        prompt, made = sum(len(r.job.ids) for r in rs if r.first), sum(r.made for r in rs)
        return {"prompt_tokens": prompt, "completion_tokens": made, "total_tokens": prompt + made}

    async def events(rs: list[Choice]):
        """The choices' events until each is done (past the deadline by 5 s: cancelled,
        ended with "length")."""
        left = {r.index for r in rs}
        while left:
            try:
                ev = await rs[0].events.get(max(0.1, rs[0].deadline - time.monotonic() + 5))
            except asyncio.TimeoutError:
                for r in rs:
                    r.cancelled = True
                for i in sorted(left):
                    yield (i, "done", "length", [])
                return
            if ev[1] == "done":
                left.discard(ev[0])
            yield ev

    def chunks(r: Choice, parser, i: int, what: str, value, lps) -> list[dict]:
        """A chat choice's chunks for one event: its text as deltas of content, reasoning
        and tool calls (:class:`tools.Stream`), or as they come where nothing is parsed."""
        if what == "done":
            deltas = parser.end() if parser is not None else []
            reason = "tool_calls" if parser is not None and parser.calls and value == "stop" else value
            out = [{"index": i, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
            return out + [{"index": i, "delta": {}, "logprobs": None, "finish_reason": reason}]
        deltas = parser.feed(value) if parser is not None else [{"content": value}]
        if not deltas and lps is None:
            return []
        deltas = deltas or [{}]
        return [{"index": i, "delta": d, "logprobs": lps if k == 0 else None, "finish_reason": None}
                for k, d in enumerate(deltas)]  # fmt: skip

    async def stream(rs: list[Choice]):
        chat_kind = rs[0].kind == "chat"
        obj = "chat.completion.chunk" if chat_kind else "text_completion"
        parsers = [tools.Stream(r.tools, r.reasoning, r.opened) if chat_kind and (r.tools or r.reasoning) else None
                   for r in rs]  # fmt: skip
        finished = False
        try:
            async for i, what, value, records in events(rs):
                r = rs[i]
                if what == "done":
                    text, lps, reason = None, None, value
                else:
                    text, reason = value, None
                    lps = logprobs(r, records, r.job.ids if what == "echo" else None)
                if chat_kind:
                    for choice in chunks(r, parsers[i], i, what, value, lps):
                        yield f"data: {json.dumps(envelope(rs[0], obj, [choice]))}\n\n"
                    continue
                else:
                    choice = {"index": i, "text": text or "", "logprobs": lps, "finish_reason": reason}
                yield f"data: {json.dumps(envelope(rs[0], obj, [choice]))}\n\n"
            if rs[0].include_usage:
                yield f"data: {json.dumps(envelope(rs[0], obj, [], usage=usage(rs)))}\n\n"
            yield "data: [DONE]\n\n"
            finished = True
        finally:
            if not finished:  # the client went away: free the rows at the next step
                for r in rs:
                    r.cancelled = True

    def reply(r: Choice, body: str, finish: str) -> tuple[dict, str]:
        """A chat choice's message: its reasoning and its tool calls parsed out where asked."""
        message: dict = {"role": "assistant", "content": body}
        if r.reasoning:
            thought, body = tools.split_reasoning(body, r.opened)
            if thought is not None:
                message["reasoning_content"], message["content"] = thought, body
        if r.tools is not None and r.tools.choice != "none":
            content, calls = tools.split(body, r.tools.family)
            if calls:
                message["content"], message["tool_calls"] = content or None, calls
                finish = "tool_calls" if finish == "stop" else finish
        return message, finish

    async def whole(rs: list[Choice]) -> dict:
        text: list[list[str]] = [[] for _ in rs]
        ids: list[list[int]] = [[] for _ in rs]
        records: list[list] = [[] for _ in rs]
        reason = ["stop"] * len(rs)
        async for i, what, value, recs in events(rs):
            if what == "done":
                reason[i] = value
                continue
            text[i].append(value)
            ids[i] += rs[i].job.ids if what == "echo" else [rec[0] for rec in recs]
            records[i] += recs
        choices = []
        for i, r in enumerate(rs):
            body, lps = "".join(text[i]), logprobs(r, records[i], ids[i])
            if r.kind == "chat":
                message, finish = reply(r, body, reason[i])
                choices.append({"index": i, "message": message, "logprobs": lps, "finish_reason": finish})
            else:
                choices.append({"index": i, "text": body, "logprobs": lps, "finish_reason": reason[i]})
        obj = "chat.completion" if rs[0].kind == "chat" else "text_completion"
        return envelope(rs[0], obj, choices, usage=usage(rs))

    return app


class HTTPServer:
    """uvicorn serving ``make_app(service)`` from a thread of rank 0."""

    def __init__(self, service: Service, host: str, port: int):
        config = uvicorn.Config(
            make_app(service), host=host, port=port, log_level="warning", lifespan="off", timeout_graceful_shutdown=2
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="mpitp-http", daemon=True)
        self.thread.start()
        while not self.server.started and self.thread.is_alive():
            time.sleep(0.01)
        if not self.server.started:
            raise OSError(f"cannot serve at http://{host}:{port} (see the message above)")

    def shutdown(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def start_http(service: Service, host: str, port: int) -> HTTPServer:
    return HTTPServer(service, host, port)
