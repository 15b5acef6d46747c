"""specd's IPC wire contract: message types, the protocol version and validation of untrusted frames.

Every frame is one msgpack map. Requests carry ``{"v", "type", "id", ...}``; ``id`` is chosen by the
client and is unique among its own in-flight requests (the server scopes it by the socket identity).
A generate request is answered by zero or more ``tokens`` replies and then exactly one ``done`` or
``error`` reply. This module is the only place that knows field names; the server, the client and the
tests go through it, so a change of the wire format is a change of this file and ``PROTOCOL_VERSION``.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import msgpack
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator, model_validator

from specd.sampling_params import SamplingParams, SpeculationParams

PROTOCOL_VERSION = 1
SOCKET_NAME = "specd.sock"
# A 128k-token prompt as msgpack ints is < 1 MiB; 16 MiB leaves room for long text prompts and chats
# while bounding what one bad peer can make the server buffer.
MAX_FRAME_BYTES = 16 << 20
MAX_ID = (1 << 63) - 1


def socket_address(run_dir: str | object) -> str:
    """The ZeroMQ address of the main socket under a run directory."""
    return f"ipc://{run_dir}/{SOCKET_NAME}"


class ProtocolError(Exception):
    """An undecodable or invalid frame. ``msg_id`` is the request id when it could be read, else None."""

    def __init__(self, code: str, message: str, msg_id: int | None = None):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.msg_id = msg_id


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    v: Literal[PROTOCOL_VERSION]
    id: int = Field(ge=0, le=MAX_ID)


class ChatMessage(BaseModel):
    """One chat turn, already reduced to plain text (the gateway flattens OpenAI content parts)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str = Field(max_length=MAX_FRAME_BYTES)


class Generate(_Message):
    """Start one generation. Exactly one of ``prompt`` (text or token ids) and ``messages`` is set."""

    type: Literal["generate"]
    prompt: str | list[Annotated[int, Field(ge=0, lt=1 << 31)]] | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    params: SamplingParams = Field(default_factory=SamplingParams)
    session: str | None = Field(None, max_length=256)
    # when the session's next turn is expected (the client's think time); kvd keeps its blocks until then
    expected_return_s: float | None = Field(None, ge=0.0, le=3600.0, allow_inf_nan=False)
    # OpenAI-style tool schemas, rendered by the chat template (only with ``messages``)
    tools: list[dict[str, Any]] | None = Field(None, max_length=1024)
    # speculative decoding for this request, overriding the deployment's: a method name ("none" turns it
    # off) or a map {method, schedule, num_speculative_tokens}
    speculation: SpeculationParams | None = None

    @field_validator("speculation", mode="before")
    @classmethod
    def _method_shorthand(cls, value: Any) -> Any:
        return {"method": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _one_prompt_form(self) -> "Generate":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of 'prompt' and 'messages' must be set")
        if self.tools is not None and self.messages is None:
            raise ValueError("'tools' needs 'messages' (they are rendered by the chat template)")
        return self


class Cancel(_Message):
    """Stop a generation and free its KV blocks. Idempotent: an unknown id is ignored."""

    type: Literal["cancel"]


class StatsRequest(_Message):
    """Ask for the engine's flat counters plus the server's own."""

    type: Literal["stats"]


class InfoRequest(_Message):
    """Ask what is served: model name and context length (the gateway's /v1/models)."""

    type: Literal["info"]


ClientMessage = Annotated[Union[Generate, Cancel, StatsRequest, InfoRequest], Field(discriminator="type")]
_client_message = TypeAdapter(ClientMessage)
CLIENT_TYPES = ("generate", "cancel", "stats", "info")


def pack(message: dict[str, Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def _unpack_map(frame: bytes) -> dict[str, Any]:
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError("frame_too_large", f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        obj = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for garbage input
        raise ProtocolError("malformed", f"not a msgpack frame: {type(exc).__name__}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("malformed", f"frame must be a map, got {type(obj).__name__}")
    return obj


def _readable_id(obj: dict[str, Any]) -> int | None:
    msg_id = obj.get("id")
    return msg_id if type(msg_id) is int and 0 <= msg_id <= MAX_ID else None


def decode_request(frame: bytes) -> Generate | Cancel | StatsRequest | InfoRequest:
    """Parse one client frame; raise ProtocolError with a stable code for anything invalid.

    Codes: ``frame_too_large``, ``malformed``, ``bad_version``, ``unknown_type``, ``invalid_params``
    (the sampling parameters are wrong) and ``bad_request`` (any other field).
    """
    obj = _unpack_map(frame)
    msg_id = _readable_id(obj)
    if obj.get("v") != PROTOCOL_VERSION:
        raise ProtocolError("bad_version", f"protocol version {obj.get('v')!r}, server speaks {PROTOCOL_VERSION}",
                            msg_id)
    if obj.get("type") not in CLIENT_TYPES:
        raise ProtocolError("unknown_type", f"unknown message type {str(obj.get('type'))[:64]!r}", msg_id)
    try:
        return _client_message.validate_python(obj)
    except ValidationError as exc:
        raise _validation_error(exc, msg_id) from None


def _validation_error(exc: ValidationError, msg_id: int | None) -> ProtocolError:
    # The deepest error is the specific one (a union reports every member it tried, shallowest first).
    first = max(exc.errors(include_url=False), key=lambda e: len(e["loc"]))
    loc = [str(part) for part in first["loc"][1:]]  # loc[0] is the union tag
    code = "invalid_params" if loc[:1] == ["params"] else "bad_request"
    where = ".".join(loc) or "frame"
    return ProtocolError(code, f"{where}: {first['msg']}", msg_id)


# ---- replies (server -> client) ----

def tokens_reply(msg_id: int, token_ids: list[int], text: str) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "type": "tokens", "id": msg_id, "token_ids": token_ids, "text": text}


def done_reply(msg_id: int, finish_reason: str, usage: dict[str, Any]) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "type": "done", "id": msg_id, "finish_reason": finish_reason, "usage": usage}


def error_reply(msg_id: int | None, code: str, message: str) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "type": "error", "id": msg_id, "error": {"code": code, "message": message}}


def stats_reply(msg_id: int, stats: dict[str, float | int]) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "type": "stats", "id": msg_id, "stats": stats}


def info_reply(msg_id: int, model_name: str, max_model_len: int) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "type": "info", "id": msg_id, "model": model_name, "max_model_len": max_model_len}


class Reply(BaseModel):
    """A server reply as the client sees it; fields absent from a type stay at their defaults."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    v: Literal[PROTOCOL_VERSION]
    type: Literal["tokens", "done", "error", "stats", "info"]
    id: int | None
    token_ids: list[int] = []
    text: str = ""
    finish_reason: str | None = None
    usage: dict[str, Any] = {}
    error: dict[str, str] = {}
    stats: dict[str, float | int] = {}
    model: str = ""
    max_model_len: int = 0


def decode_reply(frame: bytes) -> Reply:
    """Parse one server frame; a reply the client cannot read is a ProtocolError, never a crash."""
    obj = _unpack_map(frame)
    try:
        return Reply.model_validate(obj)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        raise ProtocolError("malformed_reply", str(first["msg"]), _readable_id(obj)) from None


def generate_request(msg_id: int, *, prompt: str | list[int] | None = None, messages: list[dict] | None = None,
                     params: dict[str, Any] | None = None, session: str | None = None,
                     expected_return_s: float | None = None, tools: list[dict] | None = None,
                     speculation: str | dict[str, Any] | None = None) -> dict[str, Any]:
    msg: dict[str, Any] = {"v": PROTOCOL_VERSION, "type": "generate", "id": msg_id, "params": params or {}}
    optional = {"prompt": prompt, "messages": messages, "session": session,
                "expected_return_s": expected_return_s, "tools": tools, "speculation": speculation}
    msg.update({k: v for k, v in optional.items() if v is not None})
    return msg


def simple_request(kind: Literal["cancel", "stats", "info"], msg_id: int) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "type": kind, "id": msg_id}
