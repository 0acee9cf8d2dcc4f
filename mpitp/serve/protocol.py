"""Request bodies of the OpenAI API as typed models (pydantic), as vLLM's server has them.

Three kinds of field:

* served — validated here (a 400 naming the field when out of range), used by the engine;
* known but not served (logit_bias, suffix, penalties, best_of, tools on completions, ...) — a 400 that
  names the field, never a silent default: a client that asks for them must know;
* unknown — ignored with one warning line per request, as vLLM does.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

__all__ = ["ChatRequest", "CompletionRequest", "RequestError", "parse"]

MAX_CHOICES = 64
MAX_LOGPROBS = 20  # OpenAI's limit for top_logprobs, and vLLM's default max_logprobs


class RequestError(ValueError):
    """A request the server refuses (HTTP 400), with a message naming the field."""


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # vLLM's extension; -1 or 0: off
    stop: list[str] | None = None  # a single string is taken as a list of one
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)  # choices, one batch row each
    user: str | None = None  # an end-user id: OpenAI uses it for abuse monitoring only

    # known to the OpenAI API, not served: a value other than these defaults is refused
    NOT_SERVED: ClassVar[dict[str, Any]] = {
        "presence_penalty": 0,
        "frequency_penalty": 0,
        "logit_bias": None,
    }

    @field_validator("stop", mode="before")
    @classmethod
    def _stops(cls, v):
        return [v] if isinstance(v, str) else v


class CompletionRequest(_Common):
    # text or token ids, or a list of either: several prompts, n choices each (lm-eval's
    # local-completions sends a batch of token-id lists)
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    NOT_SERVED: ClassVar[dict[str, Any]] = {
        **_Common.NOT_SERVED,
        "suffix": None,
        "best_of": 1,
        "tools": None,  # tools are a chat's: /v1/chat/completions
        "tool_choice": None,
    }

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if not v or (isinstance(v[0], (str, list)) and not all(v)):
            raise ValueError("the prompt must not be empty")
        return v

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a text or a list of token ids."""
        p = self.prompt
        return [p] if isinstance(p, str) or isinstance(p[0], int) else list(p)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[TextPart] | None = None  # None: an assistant turn that only called tools
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls, as the server returned them
    tool_call_id: str | None = None  # a tool turn: the call it answers

    @field_validator("content")
    @classmethod
    def _text(cls, v):
        return v if v is None or isinstance(v, str) else "".join(p.text for p in v)  # content parts: text only

    @model_validator(mode="after")
    def _said_something(self):
        if self.content is None and not self.tool_calls:
            raise ValueError("a message needs 'content' (or, from the assistant, 'tool_calls')")
        return self

    def for_template(self) -> dict[str, Any]:
        """As chat templates read it (transformers' convention): a call's ``arguments`` as
        an object, not the JSON string OpenAI's API carries."""
        out = self.model_dump(exclude_none=True)
        out.setdefault("content", None)
        for call in out.get("tool_calls") or []:
            fn = call.get("function") or {}
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except ValueError:
                    raise ValueError(f"tool call {fn.get('name')!r}: 'arguments' is not JSON") from None
        return out


class JsonSchema(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # the grammar is always enforced


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a 'json_schema' object with a 'schema'")
        return self

    def as_dict(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    response_format: ResponseFormat | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None  # checked by mpitp.serve.tools.tools_of (a 400 naming the tool)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables: {"enable_thinking": false}
    guided_regex: str | None = None  # vLLM's extension: the reply held to a regular expression

    NOT_SERVED: ClassVar[dict[str, Any]] = {
        **_Common.NOT_SERVED,
        "functions": None,
        "function_call": None,
        "audio": None,
        "modalities": None,
        "prediction": None,
    }


def parse(body: Any, kind: Literal["chat", "text"]) -> tuple[CompletionRequest | ChatRequest, list[str]]:
    """The typed request and the unknown fields it carried (to be warned about once);
    :class:`RequestError` for anything refused."""
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    cls: type[CompletionRequest] | type[ChatRequest] = ChatRequest if kind == "chat" else CompletionRequest
    not_served = cls.NOT_SERVED
    for name, default in not_served.items():
        v = body.get(name, default)
        if v is not None and v != default and v != {} and v != []:
            raise RequestError(f"'{name}' is not supported by mpitp serve (got {v!r})")
    try:
        req = cls.model_validate(body)
    except ValidationError as e:
        raise RequestError(_readable(e)) from None
    if isinstance(req, ChatRequest) and req.top_logprobs is not None and not req.logprobs:
        raise RequestError("'top_logprobs' needs 'logprobs': true")
    unknown = sorted(k for k in (req.model_extra or {}) if k not in not_served)
    return req, unknown


def _readable(e: ValidationError) -> str:
    """The first problem pydantic found, as one line naming the field."""
    err = e.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "body"
    return f"'{where}': {err['msg']}"
