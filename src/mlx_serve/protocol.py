"""OpenAI wire models for requests (pydantic, validation only; no logic).

Replies are built as plain dicts in ``streaming``/``routes``: validating our own output
on every chunk would cost time on the hot path for nothing.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

# OpenAI fields that would change the output and that this server cannot honour yet.
# Sending them (with a non-default value) is a 400, never silently ignored.
# (Every field of the openai SDK's chat, completion and Responses create parameters, as of
# its version 3.63, is declared by a request model or listed here or below.)
UNSUPPORTED_FIELDS = frozenset({
    "audio", "modalities", "prediction", "web_search_options",
    "functions", "function_call", "verbosity", "moderation",
    # vLLM's, which its clients send in extra_body
    "use_beam_search", "bad_words", "allowed_token_ids", "truncate_prompt_tokens",
})
# Template arguments a client may pass through ``chat_template_kwargs``. ``tokenize`` and
# friends are ours to decide; anything unknown would be silently meaningless.
CHAT_TEMPLATE_KWARGS = frozenset({"enable_thinking", "thinking", "reasoning_effort",
                                  "add_generation_prompt_suffix", "documents"})
# OpenAI fields that are accepted and change nothing about the generated text.
ACCEPTED_NO_EFFECT = frozenset({"store", "metadata", "service_tier", "safety_identifier",
                                "prompt_cache_key", "prompt_cache_retention",
                                "prompt_cache_options"})


class _Request(BaseModel):
    # Unknown fields are kept so the route can reject OpenAI ones it cannot honour and
    # log (then ignore) vendor extensions, as vLLM does.
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0.0, le=100.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None
    seed: int | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    logit_bias: dict[int, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    n: Annotated[int, Field(ge=1, le=128)] = 1
    user: str | None = None
    # vLLM extension: token ids that end generation like an end-of-sequence token.
    stop_token_ids: Annotated[list[TokenId], Field(max_length=64)] | None = None
    # vLLM extensions that benchmark clients use to fix a reply's length: go on past an
    # end-of-sequence token; end no earlier than min_tokens (no EOS, stop id or stop string).
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    # vLLM extension: the matched stop string ends the reply's text instead of being cut.
    include_stop_str_in_output: bool = False
    # vLLM extension: special tokens (<|im_start|>...) add no text; false shows them.
    skip_special_tokens: bool = True
    # vLLM extension: the prompt's own tokens scored, each with this many alternatives.
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # vLLM's structured outputs, and the older fields for them (guided.py).
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: one of these constrains the whole reply."""

    model_config = ConfigDict(extra="allow")  # vLLM's other settings: see guided.REFUSED

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


# OpenAI's reasoning efforts: chat's ``reasoning_effort``, a Response's ``reasoning.effort``.
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]

# A token id as JSON writes one: an integer, not ``true`` or ``1.0``.
TokenId = StrictInt


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False
    # OpenAI pads its streamed chunks with random characters in an ``obfuscation`` field
    # against size side channels. No chunk here carries one; the text is the same.
    include_obfuscation: bool = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class RefusalPart(BaseModel):
    """An assistant's refusal, as OpenAI returns it and clients send back: text the
    assistant said."""

    type: Literal["refusal"]
    refusal: str

    @property
    def text(self) -> str:
        return self.refusal


def text_parts_only(content: Any, text_types: tuple[str, ...]) -> Any:
    """Refuse a content part that is not text (an image, audio, a file) by its type: the
    models served here read text only. Otherwise the union's error would say the content
    should have been a string."""
    if isinstance(content, list):
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind not in text_types:
                raise PydanticCustomError(
                    "unsupported_content",
                    "content parts of type '{kind}' are not supported: this server takes "
                    "text only ({allowed})",
                    {"kind": kind, "allowed": ", ".join(repr(t) for t in text_types)})
    return content


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | RefusalPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content: Any) -> Any:
        return text_parts_only(content, ("text", "refusal"))

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: dict[str, str]


class AllowedTools(BaseModel):
    """Which of the request's tools the model may call (``{"type": "function", "function":
    {"name": ...}}``, or a Response's flat ``{"type": "function", "name": ...}``), and
    whether it must call one."""

    mode: Literal["auto", "required"]
    tools: Annotated[list[dict[str, Any]], Field(min_length=1)]


class AllowedToolsChoice(BaseModel):
    """OpenAI's ``tool_choice: {"type": "allowed_tools", "allowed_tools": {...}}``."""

    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Any = None


class ChatCompletionRequest(_Request):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: (Literal["none", "auto", "required"] | NamedToolChoice | AllowedToolsChoice
                  | None) = None
    # False: at most one call; the reply ends where the first call does (OpenAI's
    # default, True, lets the model write as many as it does).
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # How much a reasoning model thinks, through its chat template (prompts.py).
    reasoning_effort: ReasoningEffort | None = None
    # Where reasoning goes in replies (vendor field, as llama.cpp's server has it).
    reasoning_format: Literal["reasoning", "reasoning_content", "both"] | None = None
    # vLLM's: the template's generation prompt, or the final message left open for the
    # reply to continue (an assistant prefill).
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class CompletionRequest(_Request):
    prompt: (
        str
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[str], Field(min_length=1, max_length=128)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]],
                    Field(min_length=1, max_length=128)]
    )
    echo: bool = False
    best_of: Annotated[int, Field(ge=1)] | None = None
    suffix: str | None = None
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_kind_of_prompt(cls, prompt: Any) -> Any:
        """A list of one kind: the union's own error for a mixed list names whichever
        member pydantic tried (``prompt.0`` should be an integer)."""
        if isinstance(prompt, list) and prompt:
            kinds = {"a string" if isinstance(p, str) else "a token-id list"
                     if isinstance(p, list) else "a token id" for p in prompt}
            if len(kinds) > 1:
                raise PydanticCustomError(
                    "mixed_prompt",
                    "a list 'prompt' holds one kind of item, token ids, strings or token-id "
                    "lists; this one mixes {kinds}", {"kinds": " and ".join(sorted(kinds))})
        return prompt


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
        if isinstance(self.output, list):
            return "".join(part.text for part in self.output)
        return self.output


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


class ResponsesRequest(BaseModel):
    """OpenAI's ``POST /v1/responses``: text in, text out; a stored earlier response may
    stand for the conversation before ``input``."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | Annotated[list[InputMessage | FunctionCallItem | FunctionCallOutputItem
                                | ReasoningItem | ItemReference], Field(min_length=1)]
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
    # As OpenAI's: up to 16 pairs of strings, kept with the response and returned in it.
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)],
                             Annotated[str, Field(max_length=512)]],
                        Field(max_length=16)] | None = None


class TokenizeRequest(BaseModel):
    """vLLM's ``/tokenize``: a completion's ``prompt`` or a chat's ``messages``."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool | None = None  # vLLM's defaults: prompt True, chat False
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: Annotated[list[TokenId], Field(max_length=1 << 20)]


_Request.model_rebuild()
ChatCompletionRequest.model_rebuild()
CompletionRequest.model_rebuild()
