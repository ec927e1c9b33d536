"""Chat templates: a model's own Jinja template, rendered the way transformers'
`apply_chat_template` renders it, so a conversation becomes the same prompt tokens.

Where the template comes from, first found wins: `--chat-template FILE`; a
`chat_template.jinja` file beside the tokenizer; `chat_template` in tokenizer_config.json
(a string, or a list of named templates: the one named "default"). Rendering happens in an
immutable Jinja sandbox with transformers' settings (trim_blocks, lstrip_blocks, the
loopcontrols extension) and globals (`raise_exception`, `strftime_now`, a `tojson` that keeps
non-ASCII text), with the tokenizer's special tokens (`bos_token`, `eos_token`, ...) and
`add_generation_prompt` as variables. The text it renders already holds the template's
special tokens, so it is tokenized without adding any (as transformers does).
"""
from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The template could not be loaded or raised while rendering (the message says why)."""


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template does not compile: {e}") from None
        self.source = source
        self.special_tokens = special_tokens

    @classmethod
    def load(cls, tokenizer_dir: str | None, override_file: str | None = None) -> ChatTemplate | None:
        """The model's template (None when it has none); raises ChatTemplateError for a file that cannot be read."""
        config = _tokenizer_config(Path(tokenizer_dir)) if tokenizer_dir else {}
        specials = {k: v for k in SPECIAL_TOKENS if (v := _token_text(config.get(k))) is not None}
        if override_file:
            try:
                return cls(Path(override_file).read_text(), specials)
            except OSError as e:
                raise ChatTemplateError(f"cannot read the chat template {override_file}: {e.strerror}") from None
        sidecar = Path(tokenizer_dir) / "chat_template.jinja" if tokenizer_dir else None
        if sidecar is not None and sidecar.is_file():
            return cls(sidecar.read_text(), specials)
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates
            source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None)
        return cls(source, specials) if isinstance(source, str) and source else None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               kwargs: Mapping[str, Any] | None = None, continue_final: bool = False) -> str:
        """The prompt text for `messages` (raises ChatTemplateError with the template's own message).
        `kwargs` (a request's chat_template_kwargs) may not set what the call itself sets.
        `continue_final`: the text ends inside the final message, right after its text, so the
        model goes on writing it (an assistant turn begun by the caller), as transformers'
        `continue_final_message` renders it."""
        kwargs = kwargs or {}
        taken = sorted({"messages", "add_generation_prompt", *self.special_tokens}.intersection(kwargs))
        if taken:
            raise ChatTemplateError(f"chat_template_kwargs may not set {', '.join(taken)}: the request's own fields "
                                    "and the tokenizer's special tokens set them")
        if not continue_final:
            return self._render(messages, add_generation_prompt, kwargs)
        if add_generation_prompt:
            raise ChatTemplateError("continue_final_message continues the final message; a generation prompt would "
                                    "open a new one: send add_generation_prompt false")
        mark = f"<<continue {uuid.uuid4().hex}>> "  # where the final message's text ends; its space shows trimming
        final = messages[-1] if messages else None
        if final is None or not isinstance(final.get("content"), str):
            raise ChatTemplateError("continue_final_message needs a final message with text to continue")
        text = self._render([*messages[:-1], {**final, "content": final["content"] + mark}], False, kwargs)
        at = text.rfind(mark.rstrip())
        if at < 0:
            raise ChatTemplateError("continue_final_message: this chat template does not write the final message's "
                                    "text as it was sent, so the model cannot continue it")
        return text[:at] if text.startswith(mark, at) else text[:at].rstrip()  # trimmed: the message's own end

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool, kwargs: Mapping[str, Any]) -> str:
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens, **kwargs)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template refused these messages: {e}") from None
        except (TypeError, ValueError, LookupError, ArithmeticError, RecursionError) as e:  # what the request's values did
            raise ChatTemplateError(f"the chat template failed on these messages ({type(e).__name__}: "
                                    f"{str(e)[:200]})") from None


def _tokenizer_config(directory: Path) -> dict[str, Any]:
    path = directory / "tokenizer_config.json"
    try:
        raw = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError) as e:
        raise ChatTemplateError(f"cannot read {path}: {e}") from None
    return raw if isinstance(raw, dict) else {}


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:  # noqa: A002 - the name templates call it with
    return datetime.now().strftime(format)


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
