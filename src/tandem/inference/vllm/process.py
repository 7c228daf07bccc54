"""The vLLM server as a child process: command line, start, health wait, log tail, stop."""

import collections
import contextlib
import ctypes
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

import tandem
from tandem.inference.config import InferenceConfig

WORKER_EXTENSION = "tandem.inference.vllm.worker_extension.TandemWorkerExtension"
PR_SET_PDEATHSIG = 1
TANDEM_SRC = str(Path(tandem.__file__).resolve().parents[1])


class VLLMDiedError(RuntimeError):
    """vLLM exited; the message ends with its last log lines."""


def vllm_command(config: InferenceConfig, python: str, port: int, api_key: str) -> list[str]:
    """vLLM's OpenAI server with tandem's worker extension, on 127.0.0.1 only (the front is public)."""
    model = config.model
    command = [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model.name,
        "--served-model-name", *served_names(config),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--api-key", api_key,
        "--dtype", "auto" if model.dtype == "auto" else model.dtype,
        "--seed", str(config.seed),
        "--worker-extension-cls", WORKER_EXTENSION,
        "--gpu-memory-utilization", str(config.vllm.gpu_memory_utilization),
        "--logprobs-mode", config.vllm.logprobs_mode,
    ]  # fmt: skip
    if config.vllm.max_model_len is not None:
        command += ["--max-model-len", str(config.vllm.max_model_len)]
    if config.vllm.enforce_eager:
        command.append("--enforce-eager")
    if model.trust_remote_code:
        command.append("--trust-remote-code")
    if config.vllm.max_lora_rank is not None:
        command += ["--enable-lora", "--max-lora-rank", str(config.vllm.max_lora_rank), "--max-loras", "1"]
    return command + config.vllm.extra_args


def served_names(config: InferenceConfig) -> list[str]:
    """Requests may name the model by its served name or by `model.name`, as on the native server;
    vLLM answers with the first."""
    names = [config.served_model_name or config.model.name, config.model.name]
    return list(dict.fromkeys(names))


def vllm_env(config: InferenceConfig) -> dict[str, str]:
    """The current environment plus what the worker extension and the admin endpoints need:
    tandem's source on PYTHONPATH (the extension is imported inside vLLM's venv), vLLM's
    development endpoints (/collective_rpc, /pause, /resume, /reset_prefix_cache) and, serving
    LoRA adapters, its adapter endpoints (/v1/load_lora_adapter)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (TANDEM_SRC, env.get("PYTHONPATH")) if p)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    if config.vllm.max_lora_rank is not None:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def new_api_key() -> str:
    """A private key between the front and vLLM, so vLLM's port cannot be used around the front.
    Hexadecimal: a URL-safe token starts with '-' one time in 64, and vLLM's argument parser
    then takes it for an option (`--api-key: expected at least one argument`)."""
    return secrets.token_hex(24)


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM if the front dies without stopping us (e.g. SIGKILL)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class VLLMProcess:
    """Runs the command in its own process group, echoes its output to our stderr with a prefix,
    and keeps the last lines for error messages."""

    def __init__(self, command: list[str], env: dict[str, str], tail_lines: int = 40) -> None:
        self.command = command
        self.env = env
        self._tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self._proc: subprocess.Popen[str] | None = None
        self._pump: threading.Thread | None = None

    def start(self) -> None:
        self._proc = subprocess.Popen(
            self.command,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
            start_new_session=True,  # its own process group: stop() reaches vLLM's engine processes too
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        self._pump = threading.Thread(target=self._pump_output, name="vllm-log", daemon=True)
        self._pump.start()

    def _pump_output(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            self._tail.append(line.rstrip())
            sys.stderr.write(f"[vllm] {line}")

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def returncode(self) -> int | None:
        return self._proc.poll() if self._proc else None

    def tail(self) -> str:
        if self._pump is not None:
            self._pump.join(timeout=1)  # let the last lines of a dead process arrive
        return "\n".join(self._tail)

    def died_error(self) -> VLLMDiedError:
        return VLLMDiedError(f"vLLM exited with code {self.returncode()}; its last output:\n{self.tail()}")

    def wait_healthy(self, url: str, timeout_s: float) -> float:
        """Poll `url` (vLLM's /health) until 200; returns seconds waited. Raises VLLMDiedError if vLLM
        exits first and TimeoutError after `timeout_s`."""
        start = time.monotonic()
        with httpx.Client(timeout=5) as client:
            while True:
                if self.returncode() is not None:
                    raise self.died_error()
                try:
                    if client.get(url).status_code == 200:
                        return time.monotonic() - start
                except httpx.TransportError:
                    pass
                if time.monotonic() - start > timeout_s:
                    raise TimeoutError(
                        f"vLLM did not answer {url} within {timeout_s:.0f} s "
                        f"(vllm.startup_timeout_s); its last output:\n{self.tail()}"
                    )
                time.sleep(0.5)

    def stop(self, timeout_s: float = 30) -> None:
        """SIGTERM to the whole process group, SIGKILL after `timeout_s`."""
        if self._proc is None or self._proc.poll() is not None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self._proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self._proc.wait(timeout=timeout_s)
                break
            except subprocess.TimeoutExpired:
                continue
        with contextlib.suppress(ProcessLookupError):  # engine processes that outlived the server
            os.killpg(self._proc.pid, signal.SIGKILL)
