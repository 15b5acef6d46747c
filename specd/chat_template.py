"""Chat templates: render a model's jinja template (from GGUF or tokenizer_config.json) in a sandbox.

Templates come from model files, which we do not trust: they run in jinja2's immutable sandbox (no
attribute access to Python internals, no mutation of our objects). The template sees the same names
transformers gives it (messages, add_generation_prompt, bos_token, eos_token, tools, raise_exception,
strftime_now, tojson), so templates written for transformers render identically.

Models without a template (stories260K) get FALLBACK_TEMPLATE, a plain transcript:

    <system text>\\n\\n            (only if a system message is present)
    User: <text>\\n
    Assistant: <text>\\n
    ...
    Assistant:                     (the generation prompt; the model continues after the colon)
"""
from __future__ import annotations

import datetime
import functools
import json
from typing import Any, Mapping, Sequence

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

FALLBACK_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}{{ m.content }}{{ '\\n\\n' }}"
    "{%- elif m.role == 'user' -%}{{ 'User: ' }}{{ m.content }}{{ '\\n' }}"
    "{%- elif m.role == 'assistant' -%}{{ 'Assistant: ' }}{{ m.content }}{{ '\\n' }}"
    "{%- else -%}{{ raise_exception('role ' ~ m.role ~ ' is not supported by the fallback template') }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'Assistant:' }}{%- endif -%}"
)


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (bad shape, or the template itself raised)."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not compile: {e}") from e


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Check roles and flatten OpenAI content parts ([{"type": "text", "text": ...}]) into one string."""
    if not messages:
        raise ChatTemplateError("messages is empty")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise ChatTemplateError(f"message {i} needs a string 'role'")
        content = m.get("content")
        if isinstance(content, list):
            if any(not isinstance(p, Mapping) or p.get("type") != "text" for p in content):
                raise ChatTemplateError(f"message {i}: only text content parts are supported")
            content = "".join(str(p.get("text", "")) for p in content)
        elif content is not None and not isinstance(content, str):
            raise ChatTemplateError(f"message {i}: content must be a string or a list of text parts")
        out.append({**m, "content": content if content is not None else ""})
    return out


def render_chat_template(
    template: str | None,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    **extra: Any,
) -> str:
    """Render `messages` with `template` (FALLBACK_TEMPLATE when None). Raises ChatTemplateError."""
    compiled = _compile(template if template else FALLBACK_TEMPLATE)
    try:
        return compiled.render(
            messages=normalize_messages(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **extra,
        )
    except ChatTemplateError:
        raise
    except (jinja2.TemplateError, TypeError, KeyError, AttributeError) as e:
        raise ChatTemplateError(f"chat template failed: {e}") from e
