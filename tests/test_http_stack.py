"""The startup lines that say what uvicorn serves HTTP with, and on what interpreter."""

from __future__ import annotations

import importlib.util
import logging
import sys

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


def _lock_lines(caplog, monkeypatch, free_threaded: bool, lock_on: bool):
    monkeypatch.setattr(http_stack.sysconfig, "get_config_var",
                        lambda name: int(free_threaded) if name == "Py_GIL_DISABLED" else None)
    monkeypatch.setattr(sys, "_is_gil_enabled", lambda: lock_on, raising=False)
    caplog.set_level(logging.INFO, logger="mlx_serve")
    http_stack.log_interpreter_lock()
    return [r for r in caplog.records if r.name == "mlx_serve"]


def test_a_standard_build_says_nothing_of_its_lock(caplog, monkeypatch):
    assert _lock_lines(caplog, monkeypatch, free_threaded=False, lock_on=True) == []


def test_a_free_threaded_build_says_its_lock_is_off(caplog, monkeypatch):
    (record,) = _lock_lines(caplog, monkeypatch, free_threaded=True, lock_on=False)
    assert record.levelno == logging.INFO and "lock off" in record.getMessage()


def test_a_free_threaded_build_warns_when_an_import_turned_its_lock_on(caplog, monkeypatch):
    (record,) = _lock_lines(caplog, monkeypatch, free_threaded=True, lock_on=True)
    assert record.levelno == logging.WARNING and "PYTHON_GIL=1" in record.getMessage()
