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
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

# OpenAI fields that would change the output and that this server cannot honour yet.
# Sending them (with a non-default value) is a 400, never silently ignored.
# (Every field of the openai SDK's chat, completion and Responses create parameters, as of
# its version 3.63, is declared by a request model or listed here, below or in
# ``protocol_responses``: tests/test_field_policy.py checks it.)
UNSUPPORTED_FIELDS = frozenset({
    "audio", "modalities", "prediction", "web_search_options",
    "functions", "function_call", "verbosity", "moderation",
    # vLLM's, which its clients send in extra_body (``echo`` and ``chat_template`` on a
    # chat: the last message's text before the reply, a template of the client's own)
    "use_beam_search", "bad_words", "allowed_token_ids", "truncate_prompt_tokens",
    "echo", "chat_template",
})
# Fields of a chat message that would change the prompt and are not served: an earlier
# audio reply by its id, and the function call of OpenAI's deprecated functions API.
MESSAGE_UNSUPPORTED = frozenset({"audio", "function_call"})
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_PENALTY_CONTEXT = 2**20  # tokens a penalty may look back over: more than any context
PENALTY_CONTEXT_FIELDS = ("repetition_context_size", "presence_context_size",
                          "frequency_context_size")
# Template arguments a client may pass through ``chat_template_kwargs``. ``tokenize`` and
# friends are ours to decide; anything unknown would be silently meaningless.
CHAT_TEMPLATE_KWARGS = frozenset({"enable_thinking", "thinking", "reasoning_effort",
                                  "add_generation_prompt_suffix", "documents"})
# OpenAI fields that are accepted and change nothing about the generated text.
ACCEPTED_NO_EFFECT = frozenset({"store", "metadata", "service_tier", "safety_identifier",
                                "prompt_cache_key", "prompt_cache_retention",
                                "prompt_cache_options"})


class NullsTakeDefaults(BaseModel):
    """OpenAI marks most request fields nullable, and its clients send null for "not
    set" (vLLM takes it): an explicit null takes the field's default. A required field's
    null stays an error."""

    @model_validator(mode="before")
    @classmethod
    def _nulls_take_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict) or None not in data.values():
            return data
        fields = cls.model_fields
        return {key: value for key, value in data.items()
                if value is not None or key not in fields or fields[key].is_required()}


class _Request(NullsTakeDefaults):
    # Unknown fields are kept so the route can reject OpenAI ones it cannot honour and
    # log (then ignore) vendor extensions, as vLLM does.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)  # "nan" is no number

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0.0, le=100.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)  # vLLM's range
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    # mlx-lm's: how many recent tokens each penalty looks at (64 by default here).
    repetition_context_size: Annotated[int, Field(ge=1, le=MAX_PENALTY_CONTEXT)] | None = None
    presence_context_size: Annotated[int, Field(ge=1, le=MAX_PENALTY_CONTEXT)] | None = None
    frequency_context_size: Annotated[int, Field(ge=1, le=MAX_PENALTY_CONTEXT)] | None = None
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
    # Chat's; vLLM's completions take it too (OpenAI's legacy completions have none).
    response_format: ResponseFormat | None = None
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
    model_config = ConfigDict(extra="allow")  # unknown ones are logged and ignored
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


def parts_text(content: str | list[Any] | None) -> str:
    """Content as its text: a string as it is, a list of text parts joined."""
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content or ())


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
    refusal: str | None = None  # an assistant's, as OpenAI returns it: text it said
    reasoning: str | None = None
    reasoning_content: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content: Any) -> Any:
        return text_parts_only(content, ("text", "refusal"))

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> ChatMessage:
        # As OpenAI: only an assistant's message may leave it out (for its tool calls).
        if self.content is None and self.role != "assistant":
            raise PydanticCustomError("missing", "a {role} message needs 'content'",
                                      {"role": self.role})
        return self

    def text(self) -> str:
        return parts_text(self.content) or self.refusal or ""


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
    # 0 asks for the prompt alone: its echo (OpenAI's legacy API allowed it) or its
    # prompt_logprobs; with neither it is refused where the request is built.
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None
    suffix: str | None = None
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _one_kind_of_prompt(cls, prompt: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        """A refused list that mixes kinds says so: the union's own error names whichever
        member pydantic tried (``prompt.0`` should be an integer). Looked at only once
        refused, so a long token-id prompt costs nothing more."""
        try:
            return handler(prompt)
        except ValidationError:
            if isinstance(prompt, list):
                kinds = {"a string" if isinstance(p, str) else "a token-id list"
                         if isinstance(p, list) else "a token id" for p in prompt}
                if len(kinds) > 1:
                    raise PydanticCustomError(
                        "mixed_prompt", "a list 'prompt' holds one kind of item, token ids, "
                        "strings or token-id lists; this one mixes {kinds}",
                        {"kinds": " and ".join(sorted(kinds))}) from None
            raise


class TokenizeRequest(BaseModel):
    """vLLM's ``/tokenize``: a completion's ``prompt`` or a chat's ``messages``."""

    model_config = ConfigDict(extra="allow")  # unknown fields: the route's field policy

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
    model_config = ConfigDict(extra="allow")  # unknown fields: the route's field policy

    model: str | None = None
    tokens: Annotated[list[TokenId], Field(max_length=1 << 20)]


_Request.model_rebuild()
ChatCompletionRequest.model_rebuild()
CompletionRequest.model_rebuild()
