"""The runner's tokenizer side, for an HTTP process whose engine runs in another process.

Request building needs the tokenizer (chat templates, prompts, tool parsers) and the
model's context and vocabulary sizes, not the model. This loads the same tokenizer the
engine process loaded, from the model folder it reported; it never runs MLX.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlx_serve.engine_wire import EngineInfo, FormatSpec
from mlx_serve.prompt_encoder import PromptEncoder


def json_tool_parser() -> Callable[..., Any]:
    """mlx-lm's parser of JSON tool calls, ``{"name": ..., "arguments": {...}}``: how a
    forced call is written whatever the model's own format (as vLLM forces calls)."""
    from mlx_lm.tool_parsers import json_tools

    return json_tools.parse_tool_call


class TokenizerSide:
    json_tool_parser = staticmethod(json_tool_parser)

    def __init__(self, tokenizer: Any, info: EngineInfo,
                 memory: Callable[[], dict[str, int]]) -> None:
        self.tokenizer = tokenizer
        self.encode = PromptEncoder(tokenizer)
        self.context_length = info.context_length
        self.vocab_size = info.vocab_size
        self.memory = memory  # the engine process's last reported figures

    def compile_response_format(self, response_format: dict) -> FormatSpec:
        """Compiled in the engine process, which answers a bad one with a 400."""
        return FormatSpec(response_format)


def load_tokenizer_side(info: EngineInfo, memory: Callable[[], dict[str, int]]
                        ) -> TokenizerSide:
    """Load the tokenizer as ``mlx_lm.load`` does (blocking: call it off the event loop)."""
    from mlx_lm.utils import load_config, load_tokenizer

    path = Path(info.model_path)
    config = load_config(path)
    tokenizer = load_tokenizer(path, None, eos_token_ids=config.get("eos_token_id"))
    return TokenizerSide(tokenizer, info, memory)
