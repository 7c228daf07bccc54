"""tandem's vLLM front without vLLM: its process lifecycle, with a stand-in for vLLM's Python (vLLM
dying at start or later ends the front with vLLM's last lines; SIGTERM to the front stops vLLM
too), and where `step: N` is read from. The stand-in (FAKE_VLLM) only answers /health; the front
before it is the real one. The backend with vLLM itself: test_vllm_backend.py."""

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tandem.inference.config import InferenceConfig
from tandem.inference.errors import APIError
from tandem.inference.protocol import UpdateWeightsRequest
from tandem.inference.vllm.process import new_api_key
from tandem.inference.vllm.proxy import VLLMFront
from tandem.net import free_port

FAKE_VLLM = """
import http.server, os, sys, threading, time
mode, pid_file = os.environ["FAKE_VLLM_MODE"], os.environ["FAKE_VLLM_PID_FILE"]
open(pid_file, "w").write(str(os.getpid()))
print("fake vllm: loading the model", flush=True)
if mode == "crash_at_start":
    print("fake vllm: ValueError: no such model", flush=True)
    sys.exit(1)
port = int(sys.argv[sys.argv.index("--port") + 1])

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *args):
        pass

server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Health)
threading.Thread(target=server.serve_forever, daemon=True).start()
if mode == "crash_later":
    time.sleep(3)
    print("fake vllm: engine core died", flush=True)
    os._exit(3)
time.sleep(600)
"""


def start_front_with_fake_vllm(tmp_path: Path, mode: str) -> tuple[subprocess.Popen, str, Path]:
    script = tmp_path / "fake_vllm.py"
    script.write_text(FAKE_VLLM)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{script}" "$@"\n')
    python.chmod(0o755)
    pid_file = tmp_path / "vllm.pid"
    port = free_port()
    env = {**os.environ, "FAKE_VLLM_MODE": mode, "FAKE_VLLM_PID_FILE": str(pid_file)}
    args = ["--backend", "vllm", "--model.name", "m", "--vllm.python", str(python), "--port", str(port)]
    process = subprocess.Popen(
        [sys.executable, "-m", "tandem.inference.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    return process, f"http://127.0.0.1:{port}", pid_file


def wait_for_health(process: subprocess.Popen, url: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[0]
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"the front did not answer /health within {timeout_s} s")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_vllm_dying_at_start_ends_the_front_with_its_last_lines(tmp_path: Path) -> None:
    process, _, _ = start_front_with_fake_vllm(tmp_path, "crash_at_start")
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 1
    assert "fake vllm: ValueError: no such model" in output.split("exited with code 1")[-1]


def test_vllm_dying_later_ends_the_front_with_its_last_lines(tmp_path: Path) -> None:
    process, url, _ = start_front_with_fake_vllm(tmp_path, "crash_later")
    try:
        wait_for_health(process, url)
        output, _ = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 1
    assert "fake vllm: engine core died" in output.split("exited with code 3")[-1]


def test_sigterm_stops_vllm_too(tmp_path: Path) -> None:
    process, url, pid_file = start_front_with_fake_vllm(tmp_path, "serve")
    try:
        wait_for_health(process, url)
        vllm_pid = int(pid_file.read_text())
        assert pid_alive(vllm_pid)
        process.terminate()
        process.communicate(timeout=45)
    finally:
        process.kill()
    deadline = time.monotonic() + 10
    while pid_alive(vllm_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(vllm_pid)


def test_step_updates_read_run_dir_on_a_filesystem_server(tmp_path: Path) -> None:
    """With the filesystem transport `step: N` is run_dir/weights/step_N (test_vllm_backend's server
    uses the broadcast transport, where `step` is received from the trainer instead)."""
    config = InferenceConfig.model_validate(
        {"backend": "vllm", "model": {"name": "m"}, "run_dir": str(tmp_path)}
    )
    front = VLLMFront(config, "http://127.0.0.1:1", "key")
    assert front.weights_path(UpdateWeightsRequest(step=3)) == (tmp_path / "weights" / "step_3").resolve()
    without = VLLMFront(
        InferenceConfig.model_validate({"backend": "vllm", "model": {"name": "m"}}),
        "http://127.0.0.1:1",
        "key",
    )
    with pytest.raises(APIError, match="'step' needs the server to know the run directory"):
        without.weights_path(UpdateWeightsRequest(step=3))


def test_the_private_api_key_is_never_taken_for_an_option() -> None:
    """vLLM's parser takes an `--api-key` value that starts with '-' for an option and exits; a
    URL-safe token did so one start in 64 (seen here as a failed start-up)."""
    keys = [new_api_key() for _ in range(2000)]
    assert not any(key.startswith("-") for key in keys) and len(set(keys)) == len(keys)
