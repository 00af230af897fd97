"""The startup line that says what uvicorn serves HTTP with."""

from __future__ import annotations

import importlib.util
import logging

import pytest

from mlx_serve import http_stack


@pytest.mark.anyio
async def test_says_httptools_is_there_when_it_is(caplog):
    caplog.set_level(logging.INFO, logger="mlx_serve")
    http_stack.log_http_stack()
    (record,) = [r for r in caplog.records if r.name == "mlx_serve"]
    assert record.levelno == logging.INFO
    assert "httptools installed" in record.getMessage()
    assert "event loop: asyncio" in record.getMessage()  # pytest's loop here, not uvloop


@pytest.mark.anyio
async def test_warns_when_uvicorn_would_parse_with_h11(caplog, monkeypatch):
    real_find_spec = importlib.util.find_spec

    def without_httptools(name, *args, **kwargs):
        return None if name == "httptools" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(http_stack.importlib.util, "find_spec", without_httptools)
    caplog.set_level(logging.INFO, logger="mlx_serve")
    http_stack.log_http_stack()
    (record,) = [r for r in caplog.records if r.name == "mlx_serve"]
    assert record.levelno == logging.WARNING
    assert "h11" in record.getMessage() and "uvicorn[standard]" in record.getMessage()


def test_needs_a_running_loop():
    with pytest.raises(RuntimeError):
        http_stack.log_http_stack()
