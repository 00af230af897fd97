"""A tiny random-weight llama for tests and benchmarks.

``build_tiny_model(dest)`` writes a complete mlx-lm model folder (config, float32
safetensors, byte-level BPE tokenizer with a ChatML chat template) in well under a
second, with no network. A decode step takes milliseconds on a CPU.

The ``lm_head`` is untied and random: with tied embeddings a random llama tends to
repeat one token forever, untied its greedy output varies with the prompt, so tests that
compare exact outputs (replay, cancellation, batching) compare something meaningful.

Only numpy and ``tokenizers`` are used (the safetensors file is written by hand), so
this module keeps the rule that only ``runner`` and ``models`` import MLX.

CLI: ``python -m mlx_serve.tiny_model --out DIR [--seed N]``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import struct

import numpy as np

__all__ = ["SPECIAL_TOKENS", "build_tiny_model"]

# Same ids as SmolLM2: <|endoftext|>=0, <|im_start|>=1, <|im_end|>=2.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_VOCAB_SIZE = 512

# With plain 1/sqrt(fan_in) weights, attention is nearly uniform and weak next to the
# embedding in the residual stream, so every chat prompt (all ending in the same
# "<|im_start|>assistant\n") got the same first tokens. Sharper attention (q/k gain) and
# a stronger attention output (v/o gain) make greedy output depend on the prompt from
# the first token (8 distinct first tokens over 10 short prompts instead of 1).
_QK_GAIN = 3.0
_VO_GAIN = 2.0

_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# With ``agentic=True``: thinking and tool-call markers (as Qwen-style templates have
# them) and a template that renders tools, tool calls, tool results and an assistant's
# earlier reasoning, so mlx-lm detects thinking and its "json_tools" parser.
AGENTIC_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
_AGENTIC_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\nTools:\n' }}"
    "{% for tool in tools %}{{ tool | tojson }}{{ '\n' }}{% endfor %}"
    "{{ 'Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message.get('reasoning_content') %}"
    "{{ '<think>\n' + message['reasoning_content'] + '\n</think>\n' }}{% endif %}"
    "{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{% set tool_call = call['function'] %}"
    "{{ '<tool_call>' }}{{ {'name': tool_call.name, 'arguments': tool_call.arguments} | tojson }}"
    "{{ '</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is not defined or enable_thinking %}{{ '<think>\n' }}{% endif %}"
    "{% endif %}"
)

# A fixed training text for the BPE merges; changing it changes every token id.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a
single step. What is the capital of France? The capital of France is Paris. Paris is a
city on the river Seine, and it is known for its museums, its cafes and its long history.
Hello, how are you today? I am fine, thank you, and how are you? Please tell me a story
about a dragon who learns to cook soup in a small kitchen near the mountains.
Once upon a time there was a little robot that wanted to write poems. Every morning it
counted the stars that were still visible: one, two, three, four, five, six, seven.
The weather is nice and the sun is shining, so we will walk to the market and buy bread,
cheese, apples, oranges, tomatoes and fresh water for the picnic in the park.
Servers answer requests; a request that waits forever is worse than an error.
Numbers like 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 and words like server, model, token,
stream, engine, batch, health, status, ready, error, timeout, cancel, retry and replay
appear in the tests. Question: why is the sky blue? Answer: because of scattering.
"""


def build_tiny_model(
    dest: pathlib.Path,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 2048,
    agentic: bool = False,
) -> pathlib.Path:
    """Write a tiny llama model folder loadable by ``mlx_lm.load(dest)``; return ``dest``.

    The same arguments always produce byte-identical files. ``agentic`` adds thinking and
    tool-call marker tokens and a template that renders tools.
    """
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError("hidden_size must divide by num_heads, num_heads by num_kv_heads")
    dest = pathlib.Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "intermediate_size": intermediate_size,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": hidden_size // num_heads,
        "rms_norm_eps": 1e-5,
        "vocab_size": _VOCAB_SIZE + (len(AGENTIC_TOKENS) if agentic else 0),
        "max_position_embeddings": max_position_embeddings,
        "rope_theta": 10000.0,
        "rope_traditional": False,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        # mlx_lm.load turns this list into the TokenizerWrapper's eos_token_ids.
        "eos_token_id": [2, 0],
    }
    _write_json(dest / "config.json", config)
    _write_safetensors(dest / "model.safetensors", _random_weights(config, seed))
    _write_tokenizer(dest, agentic)
    return dest


def _random_weights(config: dict, seed: int) -> dict[str, np.ndarray]:
    # numpy's PCG64 stream is fixed across platforms and versions, and independent of
    # any global RNG state a test might have touched.
    rng = np.random.default_rng(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim, vocab = config["head_dim"], config["vocab_size"]
    q_out = config["num_attention_heads"] * head_dim
    kv_out = config["num_key_value_heads"] * head_dim

    def linear(out_dims: int, in_dims: int, gain: float = 1.0) -> np.ndarray:
        return rng.normal(0.0, gain * in_dims**-0.5, (out_dims, in_dims)).astype(np.float32)

    weights = {"model.embed_tokens.weight": rng.normal(0.0, 1.0, (vocab, hidden))}
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}"
        weights[f"{prefix}.self_attn.q_proj.weight"] = linear(q_out, hidden, _QK_GAIN)
        weights[f"{prefix}.self_attn.k_proj.weight"] = linear(kv_out, hidden, _QK_GAIN)
        weights[f"{prefix}.self_attn.v_proj.weight"] = linear(kv_out, hidden, _VO_GAIN)
        weights[f"{prefix}.self_attn.o_proj.weight"] = linear(hidden, q_out, _VO_GAIN)
        weights[f"{prefix}.mlp.gate_proj.weight"] = linear(inter, hidden)
        weights[f"{prefix}.mlp.up_proj.weight"] = linear(inter, hidden)
        weights[f"{prefix}.mlp.down_proj.weight"] = linear(hidden, inter)
        weights[f"{prefix}.input_layernorm.weight"] = np.ones(hidden)
        weights[f"{prefix}.post_attention_layernorm.weight"] = np.ones(hidden)
    weights["model.norm.weight"] = np.ones(hidden)
    # Logits of order 1 over the vocabulary: greedy choices depend on the context.
    weights["lm_head.weight"] = linear(vocab, hidden)
    return {name: value.astype(np.float32) for name, value in weights.items()}


def _write_safetensors(path: pathlib.Path, tensors: dict[str, np.ndarray]) -> None:
    """Write the safetensors format: u64 header size, JSON header, raw little-endian data."""
    header: dict[str, object] = {"__metadata__": {"format": "mlx"}}
    blobs, offset = [], 0
    for name in sorted(tensors):
        data = np.ascontiguousarray(tensors[name], dtype="<f4").tobytes()
        shape = list(tensors[name].shape)
        header[name] = {
            "dtype": "F32",
            "shape": shape,
            "data_offsets": [offset, offset + len(data)],
        }
        blobs.append(data)
        offset += len(data)
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)  # the data must start 8-byte aligned
    with path.open("wb") as out:
        out.write(struct.pack("<Q", len(encoded)))
        out.write(encoded)
        for blob in blobs:
            out.write(blob)


def _write_tokenizer(dest: pathlib.Path, agentic: bool = False) -> None:
    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers.models import BPE

    tokenizer = Tokenizer(BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        min_frequency=1,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        # Every byte gets a token, so any text (any language, emoji) round-trips.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    if agentic:  # after training, so every other token id stays the same
        tokenizer.add_special_tokens(list(AGENTIC_TOKENS))
    tokenizer.save(str(dest / "tokenizer.json"))
    tokenizer_config = {
        # The generic fast tokenizer: exactly the pipeline in tokenizer.json.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 20,
        "chat_template": _AGENTIC_TEMPLATE if agentic else _CHAT_TEMPLATE,
    }
    _write_json(dest / "tokenizer_config.json", tokenizer_config)


def _write_json(path: pathlib.Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m mlx_serve.tiny_model",
        description="Write a tiny random-weight llama model folder for tests and benchmarks.",
    )
    parser.add_argument("--out", required=True, type=pathlib.Path, help="destination folder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--intermediate-size", type=int, default=128)
    parser.add_argument("--max-position-embeddings", type=int, default=2048)
    args = parser.parse_args(argv)
    path = build_tiny_model(
        args.out,
        seed=args.seed,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        intermediate_size=args.intermediate_size,
        max_position_embeddings=args.max_position_embeddings,
    )
    print(path)


if __name__ == "__main__":
    main()
