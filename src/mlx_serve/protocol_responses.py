"""OpenAI wire models for the Responses API's requests (pydantic, validation only), beside
chat's and the completions' in ``protocol``."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from mlx_serve.protocol import (
    INT64_MAX,
    INT64_MIN,
    AllowedTools,
    NullsTakeDefaults,
    ReasoningEffort,
    RefusalPart,
    parts_text,
    text_parts_only,
)


class InputText(BaseModel):
    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(BaseModel):
    """One message of a Responses ``input`` (the only kind of input item served here)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText | RefusalPart]

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content: Any) -> Any:
        return text_parts_only(content, ("input_text", "output_text", "refusal"))


class FunctionCallItem(BaseModel):
    """An earlier function call of the model, as a Responses input item."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(BaseModel):
    """A function call's result, as a Responses input item."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]

    @field_validator("output", mode="before")
    @classmethod
    def _text_only(cls, output: Any) -> Any:
        return text_parts_only(output, ("input_text",))

    def text(self) -> str:
        return parts_text(self.output)


class ReasoningPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(BaseModel):
    """The model's reasoning in an earlier response, as a Responses input item (what a
    client sends back when it keeps the history itself: ``input += response.output``)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["reasoning"]
    summary: list[ReasoningPart] = []
    content: list[ReasoningPart] | None = None
    encrypted_content: str | None = None


class ItemReference(BaseModel):
    """An item of a stored response, named by its id instead of sent again."""

    type: Literal["item_reference"]
    id: str


class FunctionTool(BaseModel):
    """A Responses tool: a function, described flat (not under ``function``)."""

    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    # Loaded only once a tool search finds it: there is no tool search here, so every
    # function is in the prompt from the start.
    defer_loading: Literal[False] = False
    # Who may call it: the model itself must be among them, as nothing else calls here.
    allowed_callers: list[Literal["direct", "programmatic"]] | None = None

    @field_validator("allowed_callers")
    @classmethod
    def _model_may_call(cls, callers: list[str] | None) -> list[str] | None:
        if callers is not None and "direct" not in callers:
            raise PydanticCustomError(
                "not_direct", "a function only code calls ('programmatic') is not served: "
                "nothing but the model calls functions here")
        return callers


class TextFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None

    @model_validator(mode="after")
    def _schema_named(self) -> TextFormat:
        """As OpenAI's Responses: a ``json_schema`` format names its schema and gives it."""
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("a 'json_schema' format needs its 'name' and its 'schema'")
        return self


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    format: TextFormat | None = None


# The one Responses ``include`` served: each output text's token log-probabilities (with
# ``top_logprobs`` alternatives), as chat's logprobs give them.
OUTPUT_LOGPROBS = "message.output_text.logprobs"

# Responses API fields that would change the output and that are not served here.
RESPONSES_UNSUPPORTED = frozenset({
    "conversation", "background", "prompt", "max_tool_calls",
    "context_management", "moderation", "image", "background_options", "access_programs",
})
# Fields of a Responses ``text`` setting, beside its ``format``, that are not served here.
TEXT_UNSUPPORTED = frozenset({"verbosity"})
# Responses API fields accepted that change nothing about the generated text.
RESPONSES_NO_EFFECT = frozenset({
    "service_tier", "safety_identifier",
    "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options", "stream_options",
})


class ReasoningConfig(BaseModel):
    """The Responses ``reasoning`` setting: its ``effort`` is chat's ``reasoning_effort``.
    Summaries of the reasoning are not made here (its full text comes back)."""

    model_config = ConfigDict(extra="forbid")

    effort: ReasoningEffort | None = None
    summary: str | None = None  # a 400 unless null (responses_api.as_chat_request)
    generate_summary: str | None = None
    # Which earlier reasoning the model sees again, and its execution mode: only what the
    # server does anyway is taken (the template decides what earlier turns show).
    context: Literal["auto"] | None = None
    mode: Literal["standard"] | None = None


class ResponsesNamedToolChoice(BaseModel):
    type: Literal["function"]
    name: str


class ResponsesAllowedToolsChoice(AllowedTools):
    """A Response's ``allowed_tools`` choice: chat's, with its fields at the top."""

    type: Literal["allowed_tools"]


INPUT_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning",
                    "item_reference")


class ResponsesRequest(NullsTakeDefaults):
    """OpenAI's ``POST /v1/responses``: text in, text out; a stored earlier response may
    stand for the conversation before ``input``."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)  # "nan" is no number

    model: str | None = None
    input: str | Annotated[list[InputMessage | FunctionCallItem | FunctionCallOutputItem
                                | ReasoningItem | ItemReference], Field(min_length=1)]

    @field_validator("input", mode="before")
    @classmethod
    def _known_item_types(cls, items: Any) -> Any:
        """An item of a type not served says so: the union's own error would say the
        input should have been a string."""
        if isinstance(items, list):
            for i, item in enumerate(items):
                kind = item.get("type") if isinstance(item, dict) else None
                if isinstance(kind, str) and kind not in INPUT_ITEM_TYPES:
                    raise PydanticCustomError(
                        "unknown_item_type", "input.{i}.type '{kind}' is not an input item "
                        "type served here ({allowed})",
                        {"i": i, "kind": kind,
                         "allowed": ", ".join(repr(t) for t in INPUT_ITEM_TYPES)})
        return items

    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    stream: bool = False
    text: TextConfig | None = None
    user: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: (Literal["none", "auto", "required"] | ResponsesNamedToolChoice
                  | ResponsesAllowedToolsChoice | None) = None
    parallel_tool_calls: bool | None = None  # as chat's
    truncation: Literal["auto", "disabled"] | None = None
    previous_response_id: str | None = None
    reasoning: ReasoningConfig | None = None
    store: bool = True  # as at OpenAI: kept for previous_response_id unless told not to
    include: list[str] | None = None  # only "message.output_text.logprobs" is served
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # Not OpenAI's here; chat's (and vLLM's, with its int64 range), so honoured alike.
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    # As OpenAI's: up to 16 pairs of strings, kept with the response and returned in it.
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)],
                             Annotated[str, Field(max_length=512)]],
                        Field(max_length=16)] | None = None
