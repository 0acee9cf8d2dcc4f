"""The OpenAI-compatible HTTP side, on rank 0 (the loop every rank runs: server.py).

    POST /v1/chat/completions   messages -> the model's chat template -> completion
    POST /v1/completions        prompt (text or token ids) -> completion
         stream: true           server-sent events ("data: {...}" ... "data: [DONE]")
    GET  /v1/models, /health, /metrics (Prometheus)

A ThreadingHTTPServer's threads validate a request (400 with OpenAI's error body), queue
its ``n`` choices and relay the events rank 0's loop sends them — one queue per request,
``(choice, kind, text, records)`` with kind "echo", "delta" or "done".
"""

from __future__ import annotations

import json
import queue
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ..models import chat
from . import logprobs as lp
from . import metrics
from .server import BadRequest, Request, Service


def make_handler(service: Service):
    fmt = lp.Formatter(service.tok)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # quiet: mpitp logs what matters
            pass

        def _json(self, code: int, obj) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, code: int, message: str, kind: str = "invalid_request_error") -> None:
            self._json(code, {"error": {"message": message, "type": kind, "code": code}})

        def _authorized(self) -> bool:
            if service.api_key and self.headers.get("Authorization") != f"Bearer {service.api_key}":
                self._error(401, "missing or wrong API key", "authentication_error")
                return False
            return True

        def do_GET(self):
            if self.path == "/health":
                return self._json(200, {"status": "ok"})
            if self.path == "/metrics":  # unauthenticated, as vLLM's: scrapers carry no key
                data = service.metrics.text()
                self.send_response(200)
                self.send_header("Content-Type", metrics.CONTENT_TYPE)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
            if not self._authorized():
                return
            if self.path == "/v1/models":
                return self._json(
                    200, {"object": "list", "data": [{"id": service.name, "object": "model", "owned_by": "mpitp"}]}
                )
            self._error(404, f"no route {self.path}")

        def do_POST(self):
            kind = {"/v1/chat/completions": "chat", "/v1/completions": "text"}.get(self.path)
            if kind is None:
                return self._error(404, f"no route {self.path}")
            if not self._authorized():
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"null")
                rs = service.make(body, kind)
            except (ValueError, BadRequest, chat.ChatTemplateError) as e:
                return self._error(400, str(e))
            if service.stopping.is_set():
                return self._error(503, "the server is shutting down", "server_error")
            for i, r in enumerate(rs):
                try:
                    service.inbox.put_nowait(r)
                except queue.Full:
                    for q in rs[:i]:
                        q.cancelled = True  # the choices already queued never run
                    return self._error(503, "too many requests queued; try again", "server_error")
            (self._stream if rs[0].stream else self._whole)(rs)

        # ------------------------------------------------------------------ bodies
        def _logprobs(self, r: Request, records: list, ids: list[int] | None = None):
            """The choice's ``logprobs`` for these token records (None unless asked);
            text completions count ``text_offset`` on from ``r.offset``."""
            if r.job.logprobs is None:
                return None
            if r.kind == "chat":
                return {"content": fmt.chat(records)}
            ids = [rec[0] for rec in records] if ids is None else ids
            out = fmt.completion(records, ids, r.offset)
            r.offset += sum(len(t) for t in out["tokens"])
            return out

        def _envelope(self, r: Request, obj: str, choices: list, **extra) -> dict:
            return {
                "id": f"cmpl-{r.job.id}",
                "object": obj,
                "created": r.created,
                "model": service.name,
                "choices": choices,
                **extra,
            }

        @staticmethod
        def _usage(rs: list[Request]) -> dict:
            prompt, made = len(rs[0].job.ids), sum(r.made for r in rs)
            return {"prompt_tokens": prompt, "completion_tokens": made, "total_tokens": prompt + made}

        def _events(self, rs: list[Request]):
            """The choices' events until each is done (a choice past its deadline by 5 s:
            cancelled, ended with "length")."""
            left = {r.index for r in rs}
            while left:
                try:
                    ev = rs[0].events.get(timeout=max(0.1, rs[0].deadline - time.monotonic() + 5))
                except queue.Empty:
                    for r in rs:
                        r.cancelled = True
                    for i in sorted(left):
                        yield (i, "done", "length", [])
                    return
                if ev[1] == "done":
                    left.discard(ev[0])
                yield ev

        # ------------------------------------------------------------------ replies
        def _stream(self, rs: list[Request]) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            chat_kind = rs[0].kind == "chat"
            obj = "chat.completion.chunk" if chat_kind else "text_completion"
            try:
                for i, what, value, records in self._events(rs):
                    r = rs[i]
                    if what == "done":
                        text, logprobs, reason = None, None, value
                    else:
                        text, reason = value, None
                        logprobs = self._logprobs(r, records, r.job.ids if what == "echo" else None)
                    if chat_kind:
                        delta = {"content": text} if text is not None else {}
                        choice = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
                    else:
                        choice = {"index": i, "text": text or "", "logprobs": logprobs, "finish_reason": reason}
                    self._send(self._envelope(rs[0], obj, [choice]))
                if rs[0].include_usage:
                    self._send(self._envelope(rs[0], obj, [], usage=self._usage(rs)))
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                for r in rs:
                    r.cancelled = True  # the client went away: free the rows at the next step
            self.close_connection = True

        def _send(self, chunk: dict) -> None:
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()

        def _whole(self, rs: list[Request]) -> None:
            text: list[list[str]] = [[] for _ in rs]
            ids: list[list[int]] = [[] for _ in rs]
            records: list[list] = [[] for _ in rs]
            reason = ["stop"] * len(rs)
            for i, what, value, recs in self._events(rs):
                if what == "done":
                    reason[i] = value
                    continue
                text[i].append(value)
                ids[i] += rs[i].job.ids if what == "echo" else [rec[0] for rec in recs]
                records[i] += recs
            choices = []
            for i, r in enumerate(rs):
                body, logprobs = "".join(text[i]), self._logprobs(r, records[i], ids[i])
                if r.kind == "chat":
                    message = {"role": "assistant", "content": body}
                    choices.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": reason[i]})
                else:
                    choices.append({"index": i, "text": body, "logprobs": logprobs, "finish_reason": reason[i]})
            obj = "chat.completion" if rs[0].kind == "chat" else "text_completion"
            self._json(200, self._envelope(rs[0], obj, choices, usage=self._usage(rs)))

    return Handler


def start_http(service: Service, host: str, port: int) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer((host, port), make_handler(service))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="mpitp-http", daemon=True).start()
    return server
