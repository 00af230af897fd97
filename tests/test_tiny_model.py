"""The tiny random-weight llama: loads, generates, untied, prompt-dependent, deterministic."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_serve.tiny_model import build_tiny_model, main


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def loaded(tiny_dir: Path):
    import mlx_lm

    return mlx_lm.load(str(tiny_dir))


def _greedy(loaded, question: str, max_tokens: int = 24) -> list[int]:
    import mlx_lm

    model, tokenizer = loaded
    messages = [{"role": "user", "content": question}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens)]


def test_folder_is_complete_and_untied(tiny_dir: Path) -> None:
    names = {p.name for p in tiny_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    assert "quantization" not in config


def test_loads_with_untied_float32_head(loaded) -> None:
    import mlx.core as mx

    model, _ = loaded
    assert model.args.tie_word_embeddings is False
    assert model.lm_head.weight.dtype == mx.float32
    assert model.lm_head.weight.shape == model.model.embed_tokens.weight.shape
    assert not mx.array_equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_tokenizer_chat_template_and_eos(loaded) -> None:
    _, tokenizer = loaded
    assert tokenizer.eos_token_ids == {0, 2}  # <|endoftext|>, <|im_end|>
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.encode("<|im_start|>héllo 🙂 world 42")
    assert ids[0] == 1  # special tokens are single ids
    assert tokenizer.decode(ids) == "<|im_start|>héllo 🙂 world 42"


def test_greedy_output_depends_on_prompt_and_varies(loaded) -> None:
    first = _greedy(loaded, "What is the capital of France?")
    second = _greedy(loaded, "Tell me a story about a dragon.")
    assert first != second
    for tokens in (first, second):
        assert len(set(tokens)) > 3, tokens  # not one token repeated forever


def test_greedy_output_is_reproducible(loaded) -> None:
    assert _greedy(loaded, "hello") == _greedy(loaded, "hello")


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path) -> None:
    a = build_tiny_model(tmp_path / "a", seed=7)
    b = build_tiny_model(tmp_path / "b", seed=7)
    c = build_tiny_model(tmp_path / "c", seed=8)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


def test_custom_shape_loads(tmp_path: Path) -> None:
    import mlx.core as mx
    import mlx_lm

    folder = build_tiny_model(
        tmp_path / "m", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1
    )
    model, _ = mlx_lm.load(str(folder))
    logits = model(mx.array([[1, 2, 3]]))
    assert logits.shape == (1, 3, 512)


def test_rejects_inconsistent_heads(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        build_tiny_model(tmp_path / "m", hidden_size=64, num_heads=3)


def test_cli_writes_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(["--out", str(tmp_path / "cli"), "--seed", "3"])
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli")
    assert (tmp_path / "cli" / "model.safetensors").is_file()


def test_importing_model_modules_does_not_import_mlx() -> None:
    # Layering: only runner and models touch MLX, and models only lazily.
    code = (
        "import sys, mlx_serve.tiny_model, mlx_serve.models; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')]; "
        "assert not bad, bad"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)
