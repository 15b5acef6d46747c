"""OpenAI-compatible HTTP gateway: /v1/models, /v1/completions, /v1/chat/completions, /metrics.

It reaches the engine only through ``AsyncSpecdClient`` over IPC, so it behaves the same inside the
specd process or as a separate one. Errors use OpenAI's body ``{"error": {message, type, param, code}}``:
- 400 invalid value, unknown or unsupported parameter, empty prompt, prompt longer than the context;
- 404 unknown model or route; 422 body of the wrong shape (missing field, wrong JSON type);
- 503 the engine does not answer in time or is overloaded; 500 the engine failed the request.
A streamed request is checked up to its first token before the 200 is sent, so prompt errors keep
their 4xx status; an error after that arrives as an SSE ``data: {"error": ...}`` event before [DONE].
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from client.specd_client import AsyncSpecdClient, Delta, SpecdError
from specd.metrics import GatewayMetrics
from specd.openai_schema import ChatCompletionRequest, CompletionRequest, UnsupportedValue

ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/metrics")
STATUS_BY_CODE = {"empty_prompt": 400, "prompt_too_long": 400, "invalid_params": 400, "bad_request": 400,
                  "overloaded": 503, "timeout": 503}
OPENAI_CODE = {"prompt_too_long": "context_length_exceeded"}
SHAPE_ERRORS = ("missing", "_type", "_parsing", "union_tag_invalid")  # pydantic error types that mean 422
STATS_TIMEOUT_S = 2.0  # a scrape must answer even when the engine is stuck


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def api_error_from(exc: SpecdError) -> ApiError:
    status = STATUS_BY_CODE.get(exc.code, 500)
    param = "prompt" if exc.code in ("empty_prompt", "prompt_too_long") else None
    return ApiError(status, exc.message, param=param, code=OPENAI_CODE.get(exc.code, exc.code))


def _parse(model: type[BaseModel], body: Any) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        status = 422 if any(any(s in e["type"] for s in SHAPE_ERRORS) for e in errors) else 400
        first = errors[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        code = "unknown_parameter" if first["type"] == "extra_forbidden" else (
            "invalid_type" if status == 422 else "invalid_value")
        raise ApiError(status, f"{param or 'body'}: {first['msg']}", param=param, code=code) from None


def _usage(usage: Any) -> dict[str, Any]:
    out = {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
           "total_tokens": usage.prompt_tokens + usage.completion_tokens,
           "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
           "speculation": usage.speculation or {"verifications": 0, "drafted_tokens": 0, "accepted_tokens": 0}}
    return out


def _request_fields(req: Any) -> dict[str, Any]:
    return {"speculation": req.speculation.model_dump(exclude_none=True)} if req.speculation is not None else {}


def _finish(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"


class Format:
    """The response objects of one endpoint (completion or chat), full and as stream chunks."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _envelope(self, choices: list[dict], chunk: bool) -> dict[str, Any]:
        obj = "chat.completion" if self.chat else "text_completion"
        return {"id": self.id, "object": obj + (".chunk" if chunk and self.chat else ""),
                "created": self.created, "model": self.model, "choices": choices}

    def full(self, text: str, finish_reason: str | None, usage: Any) -> dict[str, Any]:
        body = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
        choice = {"index": 0, **body, "logprobs": None, "finish_reason": _finish(finish_reason)}
        return {**self._envelope([choice], chunk=False), "usage": _usage(usage)}

    def chunk(self, text: str | None, finish_reason: str | None = None) -> dict[str, Any]:
        if self.chat:
            # "" opens the stream with the role; None is the closing chunk's empty delta.
            delta = {} if text is None else {"content": text}
            if text == "":
                delta["role"] = "assistant"
            choice = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text or ""}
        fr = _finish(finish_reason) if finish_reason else None
        return self._envelope([{**choice, "logprobs": None, "finish_reason": fr}], chunk=True)

    def usage_chunk(self, usage: Any) -> dict[str, Any]:
        return {**self._envelope([], chunk=True), "usage": _usage(usage)}


def _sse(obj: dict[str, Any] | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n"


class Gateway:
    """State shared by the routes: the IPC client, the served model's info, and the metrics."""

    def __init__(self, address: str, request_timeout_s: float):
        self.address = address
        self.request_timeout_s = request_timeout_s
        self.metrics = GatewayMetrics()
        self.client: AsyncSpecdClient | None = None
        self._info: dict[str, Any] | None = None

    @asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        self.client = AsyncSpecdClient(address=self.address, timeout_s=self.request_timeout_s)
        try:
            yield
        finally:
            await self.client.close()

    async def info(self) -> dict[str, Any]:
        """What is served, asked once; 503 while the engine does not answer."""
        if self._info is None:
            try:
                self._info = await asyncio.wait_for(self.client.info(), STATS_TIMEOUT_S)
            except (asyncio.TimeoutError, SpecdError):
                raise ApiError(503, f"the specd engine at {self.address} does not answer", code="unavailable") from None
        return self._info

    async def check_model(self, name: str) -> str:
        served = (await self.info())["model"]
        if name != served:
            raise ApiError(404, f"model '{name}' does not exist; this server serves '{served}'",
                           param="model", code="model_not_found")
        return served

    async def timed(self, deltas: AsyncIterator[Delta], t0: float) -> AsyncIterator[Delta]:
        """Pass deltas through, recording TTFT, ITL and the finished request's token counts."""
        last = None
        async with aclosing(deltas):
            async for delta in deltas:
                now = time.monotonic()
                if delta.token_ids:
                    if last is None:
                        self.metrics.ttft.observe(now - t0)
                    else:
                        for _ in delta.token_ids:
                            self.metrics.itl.observe((now - last) / len(delta.token_ids))
                    last = now
                if delta.usage is not None:
                    self.metrics.e2e.observe(now - t0)
                    u = delta.usage
                    self.metrics.observe_finished(u.prompt_tokens, u.completion_tokens, u.cached_tokens)
                yield delta

    async def respond(self, req: CompletionRequest | ChatCompletionRequest, fmt: Format,
                      deltas: AsyncIterator[Delta], t0: float) -> Response:
        """Run the request: wait for its first delta (so prompt errors are 4xx), then answer or stream."""
        deltas = self.timed(deltas, t0)
        try:
            first = await anext(deltas)
        except StopAsyncIteration:
            raise ApiError(500, "the engine ended the request without a reply") from None
        except SpecdError as exc:
            await deltas.aclose()
            raise api_error_from(exc) from None
        if req.stream:
            return StreamingResponse(self._events(fmt, first, deltas, req.include_usage()),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        pieces = [first]
        try:
            async with aclosing(deltas):
                pieces += [d async for d in deltas]
        except SpecdError as exc:
            raise api_error_from(exc) from None
        last = pieces[-1]
        return JSONResponse(fmt.full("".join(p.text for p in pieces), last.finish_reason, last.usage))

    async def _events(self, fmt: Format, first: Delta, rest: AsyncIterator[Delta],
                      include_usage: bool) -> AsyncIterator[str]:
        """SSE events; leaving early (client gone) closes ``rest``, which cancels the request in specd."""
        async with aclosing(rest):
            if fmt.chat:
                yield _sse(fmt.chunk(""))
            try:
                delta = first
                while True:
                    if delta.text:
                        yield _sse(fmt.chunk(delta.text))
                    if delta.finish_reason is not None:
                        yield _sse(fmt.chunk(None, delta.finish_reason))
                        if include_usage:
                            yield _sse(fmt.usage_chunk(delta.usage))
                        break
                    delta = await anext(rest)
            except (SpecdError, StopAsyncIteration) as exc:
                err = api_error_from(exc) if isinstance(exc, SpecdError) else ApiError(500, "stream ended early")
                yield _sse(err.body())
            yield _sse("[DONE]")


async def _json_body(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"body is not valid JSON: {exc}", code="invalid_json") from None


def _check_supported(req: CompletionRequest | ChatCompletionRequest) -> Any:
    """Unsupported values and invalid sampling settings, as 400 errors naming the parameter."""
    try:
        req.check_supported()
        return req.sampling_params()
    except UnsupportedValue as exc:
        raise ApiError(400, str(exc), param=exc.param, code="unsupported_value") from None
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise ApiError(400, f"{param}: {first['msg']}", param=param, code="invalid_value") from None


def create_app(address: str, *, request_timeout_s: float = 60.0) -> FastAPI:
    """The gateway app for the specd server at ``address`` (``ipc://.../specd.sock``)."""
    gw = Gateway(address, request_timeout_s)
    app = FastAPI(title="specd", lifespan=gw.lifespan)
    app.state.gateway = gw
    app.add_middleware(CountRequests, metrics=gw.metrics)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(ApiError(exc.status_code, str(exc.detail), code="not_found").body(),
                            status_code=exc.status_code)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        info = await gw.info()
        return {"object": "list", "data": [{"id": info["model"], "object": "model", "created": 0,
                                            "owned_by": "specd", "max_model_len": info["max_model_len"]}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        t0 = time.monotonic()
        req: CompletionRequest = _parse(CompletionRequest, await _json_body(request))
        served = await gw.check_model(req.model)
        params = _check_supported(req).model_dump(exclude_unset=True)
        deltas = gw.client.stream(req.single_prompt(), session=req.session, **_request_fields(req), **params)
        return await gw.respond(req, Format(chat=False, model=served), deltas, t0)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        t0 = time.monotonic()
        req: ChatCompletionRequest = _parse(ChatCompletionRequest, await _json_body(request))
        served = await gw.check_model(req.model)
        params = _check_supported(req).model_dump(exclude_unset=True)
        deltas = gw.client.stream(messages=req.plain_messages(), session=req.session, **_request_fields(req), **params)
        return await gw.respond(req, Format(chat=True, model=served), deltas, t0)

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            stats = await asyncio.wait_for(gw.client.stats(), STATS_TIMEOUT_S)
        except (asyncio.TimeoutError, SpecdError):
            stats = None
        gw.metrics.set_engine_stats(stats)
        return Response(gw.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


class CountRequests:
    """ASGI middleware counting answered requests by endpoint and status (pure ASGI, so it does not
    interfere with streaming or disconnect detection as BaseHTTPMiddleware would)."""

    def __init__(self, app: Any, metrics: GatewayMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_and_note(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"
            self.metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()
