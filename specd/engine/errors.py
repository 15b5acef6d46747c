"""Typed engine errors: the server maps ``code`` to an IPC error reply and the gateway to an HTTP status."""
from __future__ import annotations


class EngineError(Exception):
    """A request the engine refuses. ``code`` is stable and machine-readable; ``message`` is for people.

    Codes: ``empty_prompt``, ``prompt_too_long``, ``bad_request``, ``duplicate_id``, ``overloaded``.
    """

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
