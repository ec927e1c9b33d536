"""The OpenAI API's request and response shapes, and their mapping onto the router's `Ask`.

    JSON body --(pydantic, strict types, unknown fields refused by name)--> CompletionRequest | ChatRequest
              --(sampling_of, once a request; ask_of, once a prompt)--> Ask (the router's one form:
                 the gRPC door's message converts to it too; `Frontend.prepare` checks the rest)
    pb.GenerateResponse stream --(Output, router/openai_output.py)--> OpenAI JSON: whole, or as chunks

Only what this module can know without the model is checked here: types, fields the
engine does not implement, and integer ranges the workers' messages cannot hold. Value
ranges the engine owns (temperature, top_p, top_k, max_tokens, stop strings) are checked
once, by the engine's `SamplingParams`.
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

import grpc

from engine.core.request import MAX_CHOICES, MAX_TOP_LOGPROBS, Constraint, SamplingParams
from engine.types import InvalidRequestError
from router.attempt import Ask, RequestFailed
from router.request_limits import MAX_PROMPTS, BadRequest

INT32_MAX, UINT32_MAX, UINT64_MAX = 2**31 - 1, 2**32 - 1, 2**64 - 1


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    """Inside a request (a message, a part): fields OpenAI's own responses carry, which clients
    send back with the conversation (refusal, annotations...), are ignored."""


class _Request(_Body):
    model_config = ConfigDict(extra="allow", strict=True)
    """A request's own fields: each one works, or is refused by name (`parse`), but for
    `IGNORED_FIELDS`."""


IGNORED_FIELDS = frozenset({"metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
                            "prediction", "reasoning_effort", "verbosity"})
"""OpenAI's own request fields that change nothing here, ignored: metadata and storage on
OpenAI's side, its service tiers and cache keys, a predicted output (a latency hint: the
tokens are the same without it), and the reasoning hints of its own models. Any other field
this API does not implement is a 400 that names it."""

class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Request):
    model: str | None = None
    """The served model's name (None: it)."""
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: int = 0
    request_id: str | None = None
    return_token_ids: bool = False
    """vLLM's extension: each choice (and stream chunk) also carries the generated token ids."""
    skip_special_tokens: bool = True
    """vLLM's extension: False keeps special tokens in the text (never the stop token)."""
    include_stop_str_in_output: bool = False
    """vLLM's extension: the stop string that ends the text is kept in it."""
    min_tokens: int = 0
    prompt_logprobs: int | None = None
    """vLLM's extension: each prompt token's log-probability and rank, and this many
    alternatives at its position (`prompt_logprobs` in the choice)."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    """OpenAI's: {"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema", "strict"}}."""
    structured_outputs: dict[str, Any] | None = None
    """vLLM's: one of "json" (a schema), "json_object", "regex", "choice", "grammar"."""
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    """vLLM's older names for the same."""


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: str
    """The arguments as JSON text, as OpenAI sends them back."""


class ToolCallItem(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None
    """An assistant message's calls (its content may then be null)."""
    tool_call_id: str | None = None
    """A tool message: the call it answers."""
    reasoning_content: str | None = None
    """vLLM's: an assistant turn's thinking, for templates that render it (Qwen3's, within a tool loop)."""


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    """vLLM's: the prompt ends inside the final message, which the model goes on writing."""
    chat_template_kwargs: dict[str, Any] | None = None
    modalities: list[str] | None = None
    """OpenAI's: the output's kinds; only ["text"] here."""


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


def prompt_end(req: ChatRequest | TokenizeRequest) -> tuple[bool, bool]:
    """How a conversation's prompt ends: (add_generation_prompt, continue_final_message). To
    continue the final message is to open no new one: add_generation_prompt is then false
    unless the request sent it true, which contradicts it (a 400)."""
    if not req.continue_final_message:
        return req.add_generation_prompt, False
    if req.add_generation_prompt and "add_generation_prompt" in req.model_fields_set:
        raise BadRequest("continue_final_message continues the final message and add_generation_prompt opens a new "
                         "one: send one of them", "continue_final_message")
    return False, True


def parse(kind: type[_Body], body: bytes) -> Any:
    """The body as `kind` (raises BadRequest naming the first field at fault)."""
    try:
        req = kind.model_validate_json(body)
    except ValidationError as e:
        errors = e.errors(include_url=False)
    else:
        ignored = getattr(kind, "ignored", IGNORED_FIELDS)  # each API's own list (the Responses API's differs)
        unknown = sorted(set(req.model_extra or ()) - ignored)
        if unknown:
            raise BadRequest(f"unknown field '{unknown[0]}': this API does not implement it (fields OpenAI's API has "
                             f"that change nothing here are ignored: {', '.join(sorted(ignored))})", unknown[0])
        return req
    err = errors[0]
    if (refusal := not_text(errors)) is not None:
        raise BadRequest(refusal, str(err["loc"][0]))
    if err["type"] == "json_invalid":
        raise BadRequest(f"the body is not valid JSON in UTF-8: {err['msg']}")
    if err["type"] in ("json_type", "model_type"):
        raise BadRequest(f"the body must be a JSON object: {err['msg']}")
    name = str(err["loc"][0]) if err["loc"] else None
    if err["type"] == "missing":
        raise BadRequest(f"'{name}' is required", name)
    field = kind.model_fields.get(name or "")
    if field is not None and len([x for x in errors if x["loc"][:1] == err["loc"][:1]]) > 1:  # a union's branches
        raise BadRequest(f"'{name}' must be {_type_name(field.annotation)} (got {_short(err.get('input'))})", name)
    where = ".".join(str(p) for p in err["loc"])
    raise BadRequest(f"'{where}': {err['msg']} (got {_short(err.get('input'))})", name)


def not_text(errors: list[Any], where: str = "") -> str | None:
    """What to say of a content part that is not text (an image, audio, a file) among a
    validation's errors (None: there is none), so that it is named rather than lost in its
    union's errors; `where`: the path of the errors' root."""
    for e in errors:
        loc = e["loc"]
        if e["type"] == "literal_error" and loc[-1:] == ("type",) and any(
                isinstance(p, str) and p.startswith("list[") and p.endswith("Part]") for p in loc):
            path = where + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[:-1]
                                   if not (isinstance(p, str) and p.startswith("list[")))
            return (f"'{path.lstrip('.')}' is a content part of type {_short(e.get('input'))}: only text parts are "
                    "served here (its models read text)")
    return None


def _type_name(annotation: Any) -> str:
    return " or ".join(getattr(a, "__name__", str(a)) if not getattr(a, "__args__", None) else str(a)
                       for a in getattr(annotation, "__args__", (annotation,)) if a is not type(None))


def messages_as_dicts(messages: list[Message]) -> list[dict[str, Any]]:
    """Messages as chat templates read them (as transformers' apply_chat_template is given
    them): text parts joined into one string per message; a developer message as the system
    message it replaces; an assistant's calls with their arguments as objects (templates write
    them out with `tojson`); a tool message with the id of the call it answers."""
    out = []
    for i, m in enumerate(messages):
        content = m.content if not isinstance(m.content, list) else "\n".join(p.text for p in m.content)
        if m.role == "tool" and (m.tool_call_id is None or content is None):
            raise BadRequest(f"messages[{i}]: a tool message needs tool_call_id and content", "messages")
        if m.tool_calls and m.role != "assistant":
            raise BadRequest(f"messages[{i}]: only an assistant message has tool_calls", "messages")
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments, i)}} for c in m.tool_calls]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.reasoning_content is not None and m.role == "assistant":
            d["reasoning_content"] = m.reasoning_content
        out.append(d)
    return out


def _arguments(text: str, index: int) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise BadRequest(f"messages[{index}]: a tool call's arguments must be a JSON object's text, got "
                         f"{_short(text)}", "messages")
    return value


def sampling_of(req: CompletionRequest | ChatRequest, max_tokens_default: int | None,
                constraint: tuple[str, str] | None = None) -> SamplingParams:
    """The request's sampling in the engine's form, built once for all its prompts: max_tokens
    from the request, else `max_tokens_default` (None: the engine's default); `constraint`
    (kind, value) its structured output (router/constraints.py). Raises BadRequest naming the
    field, or RequestFailed (INVALID_ARGUMENT) with the engine's reason for a value it refuses."""
    _refuse_unsupported(req)
    max_tokens = req.max_tokens
    max_name = "max_tokens"
    if isinstance(req, ChatRequest) and req.max_completion_tokens is not None:
        max_tokens, max_name = req.max_completion_tokens, "max_completion_tokens"
    if max_tokens is None:
        max_tokens = max_tokens_default
    if max_tokens == 0 and isinstance(req, CompletionRequest) and req.echo:
        max_tokens = 1  # the prompt scored, nothing generated: one token drawn, not returned (Output.hide)
    choices = max(req.n, (req.best_of or 1) if isinstance(req, CompletionRequest) else 1)
    if isinstance(req, ChatRequest):
        logprobs, top_logprobs = req.logprobs, req.top_logprobs or 0
    else:  # best_of ranks its choices by their log-probabilities: it needs them
        logprobs, top_logprobs = req.logprobs is not None or choices > req.n, req.logprobs or 0
    prompt_logprobs = req.prompt_logprobs
    if isinstance(req, CompletionRequest) and req.echo and req.logprobs is not None:
        prompt_logprobs = max(req.logprobs, prompt_logprobs or 0)  # the echoed prompt's logprobs
    bias = _logit_bias(req.logit_bias or {})
    fields: dict[str, Any] = {} if max_tokens is None else {
        "max_tokens": _within(max_tokens, max_name, -INT32_MAX, INT32_MAX)}
    try:
        return SamplingParams(
            **fields, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k in (None, -1) else _within(req.top_k, "top_k", -INT32_MAX, INT32_MAX),  # -1: off
            seed=None if req.seed is None else _within(req.seed, "seed", 0, UINT64_MAX),
            stop=tuple([req.stop] if isinstance(req.stop, str) else req.stop or ()),
            include_stop_str_in_output=req.include_stop_str_in_output,
            stop_token_ids=tuple(_token_ids(req.stop_token_ids or [], "stop_token_ids")),
            ignore_eos=req.ignore_eos, logprobs=logprobs, top_logprobs=top_logprobs,
            prompt_logprobs=None if prompt_logprobs is None else _within(prompt_logprobs, "prompt_logprobs", 0,
                                                                         UINT32_MAX),
            skip_special_tokens=req.skip_special_tokens, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            min_p=req.min_p or 0.0, logit_bias=tuple(sorted(bias.items())),
            min_tokens=_within(req.min_tokens, "min_tokens", 0, UINT32_MAX),
            constraint=None if constraint is None else Constraint(*constraint), n=choices)
    except InvalidRequestError as e:
        raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None


def ask_of(req: CompletionRequest | ChatRequest, client_id: str, prompt: str | list[int], params: SamplingParams,
           route: str) -> Ask:
    """The router's request for `prompt` (a chat's rendered token ids, or one of a completion's
    prompts: `prompts_of`) with `params` (`sampling_of`)."""
    if not isinstance(prompt, str):
        _token_ids(prompt, "prompt")
    return Ask(prompt, params, client_id, req.user or "", _within(req.priority, "priority", -INT32_MAX, INT32_MAX),
               route)


def _refuse_unsupported(req: CompletionRequest | ChatRequest) -> None:
    if not 1 <= req.n <= MAX_CHOICES:
        raise BadRequest(f"n={req.n}: between 1 and {MAX_CHOICES} choices per request", "n")
    if req.stream_options is not None and not req.stream:
        raise BadRequest("stream_options is only allowed with stream=true", "stream_options")
    for name in ("prompt_logprobs", "logprobs" if isinstance(req, CompletionRequest) else "top_logprobs"):
        value = getattr(req, name)
        if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
            raise BadRequest(f"{name}={value}: at most {MAX_TOP_LOGPROBS} alternatives per token", name)
    if isinstance(req, CompletionRequest):
        if req.best_of is not None and not req.n <= req.best_of <= MAX_CHOICES:
            raise BadRequest(f"best_of={req.best_of}: between n={req.n} and {MAX_CHOICES}", "best_of")
        if (req.best_of or req.n) > req.n and req.stream:
            raise BadRequest("best_of > n cannot stream: which choices are best is known at their end", "best_of")
        if req.suffix:
            raise BadRequest("suffix is not supported", "suffix")
        if req.max_tokens == 0 and not req.echo:
            raise BadRequest("max_tokens=0 returns nothing; send echo=true to score the prompt alone", "max_tokens")
        return
    if req.top_logprobs and not req.logprobs:
        raise BadRequest("top_logprobs needs logprobs=true", "top_logprobs")
    if req.modalities not in (None, ["text"]):
        raise BadRequest(f"modalities {req.modalities}: only text is produced here; send [\"text\"]", "modalities")


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's logit_bias, {"token id": bias}, with integer keys (the engine checks the values)."""
    out = {}
    for key, value in bias.items():
        if not key.isascii() or not key.isdigit() or int(key) > UINT32_MAX:
            raise BadRequest(f"logit_bias keys are token ids (\"0\", \"1\", ...), got {_short(key)}", "logit_bias")
        out[int(key)] = value
    return out


def prompts_of(prompt: str | list[int] | list[str] | list[list[int]]) -> list[str | list[int]]:
    """A completion request's prompts: one (text, or token ids), or a list of them, each its
    own choice (at most MAX_PROMPTS)."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return [prompt]  # type: ignore[list-item]
    if len(prompt) > MAX_PROMPTS:
        raise BadRequest(f"prompt holds {len(prompt)} prompts; at most {MAX_PROMPTS} per request", "prompt")
    return list(prompt)


def _token_ids(ids: list[int], param: str) -> list[int]:
    bad = [t for t in ids if not 0 <= t <= UINT32_MAX]
    if bad:
        raise BadRequest(f"'{param}' holds token ids {bad[:5]} that are not token ids (0 or more)", param)
    return ids


def _within(value: int, param: str, low: int, high: int) -> int:
    if not low <= value <= high:
        raise BadRequest(f"'{param}' is {value}, outside [{low}, {high}]", param)
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
