"""One configuration, three ways to start: env (uvicorn), CLI flags, python -m."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from mlx_serve.cli import settings_from_args
from mlx_serve.config import Settings
from tests.server_process import free_port


def test_settings_come_from_mlx_serve_environment_variables(monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_SERVE_MODEL", str(tmp_path))
    monkeypatch.setenv("MLX_SERVE_DECODE_BATCH_SIZE", "7")
    monkeypatch.setenv("MLX_SERVE_EXIT_ON_FATAL", "true")
    settings = Settings()
    assert (settings.model, settings.decode_batch_size, settings.exit_on_fatal) == (
        str(tmp_path), 7, True)
    assert (settings.host, settings.port) == ("127.0.0.1", 8000)


def test_flags_override_and_mirror_the_settings(monkeypatch):
    monkeypatch.setenv("MLX_SERVE_PORT", "9001")
    settings = settings_from_args(["--model", "m", "--port", "9002", "--exit-on-fatal",
                                   "--no-openblas", "--step-timeout", "2.5"])
    assert (settings.model, settings.port, settings.exit_on_fatal, settings.openblas,
            settings.step_timeout) == ("m", 9002, True, False, 2.5)


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost"])
def test_debug_endpoints_are_allowed_on_loopback(host):
    assert Settings(host=host, failpoints_http=True).failpoints_http


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "example.org"])
def test_debug_endpoints_are_refused_off_loopback(host):
    with pytest.raises(ValidationError, match="loopback"):
        Settings(host=host, failpoints_http=True)


@pytest.mark.parametrize(("field", "value", "said"), [
    ("log_level", "bogus", "must be one of"),
    ("failpoints", "garbage=foo", "unknown task 'foo'"),
    ("failpoints", "engine.stpe=off", "unknown fail-point sites"),  # a typo injects nothing
    ("api_key", "   ", "is blank"),  # a key no client could send
])
def test_a_bad_log_level_or_fail_point_spec_is_a_settings_error(field, value, said):
    with pytest.raises(ValidationError, match=said):
        Settings(**{field: value})


def test_a_model_folder_that_is_not_there_is_a_settings_error(tmp_path):
    with pytest.raises(ValidationError, match="no such model folder"):
        Settings(model=str(tmp_path / "missing"))
    assert Settings(model=str(tmp_path)).model == str(tmp_path)
    assert Settings(model="org/some-model").model == "org/some-model"  # a hub id
    # ...unless its first part is a folder here: then it is a path with a typo.
    (tmp_path / "models").mkdir()
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with pytest.raises(ValidationError, match="no such model folder: models/tinym"):
            Settings(model="models/tinym")
        (tmp_path / "models" / "tinym").mkdir()
        assert Settings(model="models/tinym").model == "models/tinym"
    finally:
        os.chdir(cwd)


def test_an_empty_api_key_is_no_key_as_in_vllm(monkeypatch):
    monkeypatch.setenv("MLX_SERVE_API_KEY", "")
    assert Settings().api_key is None
    assert Settings(log_level="DEBUG").log_level == "debug"


def test_the_cli_refuses_bad_settings_with_a_clear_message():
    key = "sk-live-4f9a8b7c1234"
    done = subprocess.run([sys.executable, "-m", "mlx_serve", "--host", "0.0.0.0",
                           "--failpoints-http"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "MLX_SERVE_API_KEY": key})
    assert done.returncode == 2
    assert "loopback" in done.stderr
    # Before, pydantic's message quoted every setting given, the key's start with them.
    assert key[:6] not in done.stderr and "input_value" not in done.stderr


def test_plain_uvicorn_refuses_bad_settings_with_the_same_message_not_a_traceback():
    done = subprocess.run([sys.executable, "-m", "uvicorn", "mlx_serve.app:app",
                           "--port", str(free_port())], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "MLX_SERVE_DECODE_BATCH_SIZE": "0"})
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert ("decode_batch_size (--decode-batch-size, MLX_SERVE_DECODE_BATCH_SIZE): "
            "Input should be greater than or equal to 1") in done.stderr


def test_empty_settings_are_unset_and_an_empty_host_is_refused(monkeypatch):
    # A deployment template's unset values: before, MLX_SERVE_MODEL= served the working
    # directory as a model, and an empty host listened on every interface.
    for name in ("MODEL", "CACHE_DIR", "SERVED_MODEL_NAME", "ALLOWED_ORIGINS"):
        monkeypatch.setenv(f"MLX_SERVE_{name}", "")
    settings = Settings()
    assert (settings.model, settings.cache_dir, settings.served_model_name,
            settings.allowed_origins) == (None, None, None, None)
    with pytest.raises(ValidationError, match="host"):
        Settings(host="")


def test_every_empty_variable_is_its_setting_unset(monkeypatch):
    # Before, only six settings took an empty variable for unset: MLX_SERVE_PORT= and
    # MLX_SERVE_ACCESS_LOG= stopped the server (plain uvicorn too) with exit status 2.
    defaults = Settings()
    for name in Settings.model_fields:
        monkeypatch.setenv(f"MLX_SERVE_{name.upper()}", "")
    assert Settings() == defaults


def test_a_cache_folder_under_home_is_expanded(monkeypatch, tmp_path):
    # A unit file's or a Kubernetes env entry's "~" reaches us unexpanded; before, the
    # default model was converted into a folder named "~" under the working directory.
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("MLX_SERVE_CACHE_DIR", "~/models")
    assert Settings().cache_dir == tmp_path / "models"


def test_an_api_key_from_a_file_loses_its_newline(monkeypatch):
    monkeypatch.setenv("MLX_SERVE_API_KEY", "sekret-key-123\n")
    assert Settings().api_key == "sekret-key-123"  # no header can carry the newline


def test_an_mlx_cache_limit_past_what_mlx_takes_is_a_settings_error():
    with pytest.raises(ValidationError, match="mlx_cache_limit_bytes"):
        Settings(mlx_cache_limit_bytes=2**70)  # before: a TypeError at load, state failed


@pytest.mark.parametrize("code, status, said", [(3, 3, ""), (None, 0, ""),
                                                ("cannot serve", 1, "cannot serve\n")])
def test_uvicorns_own_exit_leaves_without_interpreter_teardown(monkeypatch, capsys, tmp_path,
                                                               code, status, said):
    """A port in use makes uvicorn shut down and raise SystemExit(3); the CLI then
    leaves through ``_exit_now`` as after any shutdown, never through the interpreter's
    teardown, where MLX's native threads abort the process now and then. The status is
    the one the interpreter would have given the exit."""
    from mlx_serve import cli, serving

    class Left(Exception):
        pass

    def exit_now(code: int):
        raise Left(code)

    def run(self):
        raise SystemExit(code)

    monkeypatch.setattr(serving.DrainingServer, "run", run)
    monkeypatch.setattr(cli, "_exit_now", exit_now)
    with pytest.raises(Left) as left:
        cli.main(["--model", str(tmp_path), "--no-openblas", "--no-jemalloc"])
    assert left.value.args == (status,)
    assert capsys.readouterr().err.endswith(said)


def test_a_port_in_use_ends_the_server_with_status_3(tiny_model_dir):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "mlx_serve", "--model", str(tiny_model_dir),
                               "--port", str(port), "--no-openblas", "--no-jemalloc"],
                              capture_output=True, text=True, timeout=90)
    assert done.returncode == 3, done.stderr[-2000:]
    assert "address already in use" in done.stderr
    assert "terminate called" not in done.stderr


def test_mlx_serve_entry_point_is_installed():
    script = Path(sys.executable).parent / "mlx-serve"
    done = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "--decode-batch-size" in done.stdout
    # Each setting's default, where it has one (the flag's own stays unset for its variable).
    assert "(default: 32)" in done.stdout and "(default: 127.0.0.1)" in " ".join(
        done.stdout.split())


@contextmanager
def plain_uvicorn(tmp_path: Path, settings: dict[str, str], host: str = "127.0.0.1"
                  ) -> Iterator[int]:
    """``uvicorn mlx_serve.app:app`` on ``host`` with MLX_SERVE_* ``settings``, ready
    (bounded); its port. Stopped on the way out."""
    port = free_port()
    with open(tmp_path / "uvicorn.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "mlx_serve.app:app",
                                 "--host", host, "--port", str(port)],
                                stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **settings})
    try:
        deadline = time.monotonic() + 120
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
            while True:
                assert proc.poll() is None, (tmp_path / "uvicorn.log").read_text()
                assert time.monotonic() < deadline, "not ready in 120 s"
                try:
                    if client.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        proc.wait(30)


def test_plain_uvicorn_serves_with_settings_from_the_environment(tiny_model_dir, tmp_path):
    with plain_uvicorn(tmp_path, {"MLX_SERVE_MODEL": str(tiny_model_dir),
                                  "MLX_SERVE_SERVED_MODEL_NAME": "from-env",
                                  "MLX_SERVE_DECODE_BATCHSIZE": "4"}) as port:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
            models = client.get("/v1/models").json()["data"]
            reply = client.post("/v1/completions", json={
                "prompt": "hi", "max_tokens": 3, "temperature": 0,
                "logit_bias": {"0": -100, "2": -100}})  # no end-of-sequence: exactly 3
    assert [m["id"] for m in models] == ["from-env"]
    assert reply.json()["usage"]["completion_tokens"] == 3
    log = (tmp_path / "uvicorn.log").read_text()
    # Before, no line of the server's own reached uvicorn's output but warnings.
    assert "INFO mlx_serve: event loop: uvloop" in log
    assert (f"INFO mlx_serve: serving {tiny_model_dir} as 'from-env': decode batch 32, "
            "prefill 8 prompts x 512 tokens, queue 256, API key not required, engine in "
            "this process") in log
    assert ("ignored environment variables that name no setting: MLX_SERVE_DECODE_BATCHSIZE"
            " (did you mean MLX_SERVE_DECODE_BATCH_SIZE?)") in log


def _outward_address() -> str | None:
    """An address of this machine other than loopback, if it has one (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: only picks the outward interface
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") or address == "0.0.0.0" else address


def test_under_plain_uvicorn_the_fail_points_answer_only_loopback_clients_with_the_key(
        tiny_model_dir, tmp_path):
    outward = _outward_address()
    if outward is None:
        pytest.skip("this machine has no address but loopback")
    # The settings' own host is loopback (the default); uvicorn listens everywhere.
    with plain_uvicorn(tmp_path, {"MLX_SERVE_MODEL": str(tiny_model_dir),
                                  "MLX_SERVE_FAILPOINTS_HTTP": "true",
                                  "MLX_SERVE_API_KEY": "k1"}, host="0.0.0.0") as port:
        away = httpx.put(f"http://{outward}:{port}/_debug/failpoints/engine.step",
                         content="hang", headers={"Authorization": "Bearer k1"}, timeout=5)
        # Before, any client anywhere could make the engine hang, without the key.
        assert away.status_code == 403, away.text
        assert away.json()["error"]["code"] == "forbidden"
        local = f"http://127.0.0.1:{port}/_debug/failpoints"
        assert httpx.get(local, timeout=5).status_code == 401
        keyed = httpx.get(local, headers={"Authorization": "Bearer k1"}, timeout=5)
        assert keyed.status_code == 200 and keyed.json() == {}


@pytest.mark.parametrize(("args", "logged"), [([], True), (["--no-access-log"], False)])
def test_the_access_log_is_on_unless_turned_off(tiny_model_dir, tmp_path, args, logged):
    from tests.server_process import ServerProcess

    with ServerProcess(tiny_model_dir, tmp_path / "server.log", args=args) as server:
        assert httpx.get(server.base_url + "/v1/models", timeout=10).status_code == 200
        # uvicorn logs the line when the response starts, so it is in the log (stderr is
        # line-buffered) before the client has the whole response.
        assert ('"GET /v1/models HTTP/1.1" 200' in server.log_text()) is logged
        assert "Application startup complete" in server.log_text()


def test_a_model_that_cannot_be_loaded_is_said_in_one_line_and_exits_70_when_asked(
        tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama"}')  # no weights, no tokenizer
    done = subprocess.run([sys.executable, "-m", "mlx_serve", "--model", str(broken),
                           "--port", str(free_port()), "--exit-on-fatal", "--no-openblas",
                           "--no-jemalloc"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 70, done.stderr[-3000:]
    assert "CRITICAL mlx_serve.engine: the model could not be loaded: " in done.stderr
