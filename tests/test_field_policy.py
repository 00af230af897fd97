"""Every field of the openai SDK's create parameters has a place in the field policy:
declared by a request model, refused when it would change the output, or accepted as
changing nothing. A field in none of them would be ignored with a warning: silently
dropped, for an OpenAI field."""

from __future__ import annotations

import openai
import pytest
from openai.types import chat as chat_types
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params
from openai.types.responses import response_create_params
from packaging.version import Version

from mlx_serve import protocol, protocol_responses

CHECKED_AGAINST = Version("3.63.0")  # the SDK version the lists were last checked against

POLICIES = {
    "chat": (chat_create_params.CompletionCreateParamsBase, protocol.ChatCompletionRequest,
             protocol.UNSUPPORTED_FIELDS | protocol.ACCEPTED_NO_EFFECT),
    "completions": (completion_create_params.CompletionCreateParamsBase,
                    protocol.CompletionRequest,
                    protocol.UNSUPPORTED_FIELDS | protocol.ACCEPTED_NO_EFFECT),
    "responses": (response_create_params.ResponseCreateParamsBase,
                  protocol_responses.ResponsesRequest,
                  protocol_responses.RESPONSES_UNSUPPORTED
                  | protocol_responses.RESPONSES_NO_EFFECT),
}


@pytest.mark.parametrize("endpoint", sorted(POLICIES))
def test_every_sdk_field_has_a_place_in_the_policy(endpoint):
    params, model, listed = POLICIES[endpoint]
    unplaced = set(params.__annotations__) - set(model.model_fields) - listed
    if unplaced and Version(openai.__version__) > CHECKED_AGAINST:
        pytest.skip(f"openai {openai.__version__} has {endpoint} fields newer than the "
                    f"policy: {sorted(unplaced)}")
    assert not unplaced


@pytest.mark.parametrize("message", [
    chat_types.ChatCompletionAssistantMessageParam, chat_types.ChatCompletionUserMessageParam,
    chat_types.ChatCompletionSystemMessageParam, chat_types.ChatCompletionDeveloperMessageParam,
    chat_types.ChatCompletionToolMessageParam,
])
def test_every_sdk_message_field_has_a_place_in_the_policy(message):
    unplaced = (set(message.__annotations__) - set(protocol.ChatMessage.model_fields)
                - protocol.MESSAGE_UNSUPPORTED)
    if unplaced and Version(openai.__version__) > CHECKED_AGAINST:
        pytest.skip(f"openai {openai.__version__} has message fields newer than the "
                    f"policy: {sorted(unplaced)}")
    assert not unplaced
