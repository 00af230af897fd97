"""The module boundaries DESIGN.md promises, checked on the source's imports."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "mlx_serve"
MLX_ALLOWED = {"runner", "models"}  # the only modules that may import mlx / mlx_lm
HTTP = ("starlette", "sse_starlette", "pydantic", "uvicorn", "prometheus_client")
PURE = ("engine", "engine_state", "open_requests", "reply_channel", "generation", "recovery",
        "errors", "stop_strings", "mlx_thread", "failpoints")


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_only_the_runner_and_models_import_mlx(path: Path):
    top = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
    if top not in MLX_ALLOWED:
        assert not imported_roots(path) & {"mlx", "mlx_lm"}


@pytest.mark.parametrize("name", PURE)
def test_the_actor_side_imports_neither_http_nor_mlx(name: str):
    path = PACKAGE / f"{name}.py"
    assert not imported_roots(path) & {"mlx", "mlx_lm", *HTTP}
