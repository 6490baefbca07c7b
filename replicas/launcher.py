"""Start replicas as local processes: real vLLM (CPU or GPU) or the simulated replica.

Example::

    proc = vllm_process("/tmp/tiny/model", port=8001, served_model_name="tiny")
    proc.start()
    proc.wait_ready(timeout=180)      # raises ReplicaStartError with the log tail on failure
    ...
    proc.stop()

Used by ``tidal replica vllm``, ``tidal up``, the local-process autoscaler actuator and the test
fixtures.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = [
    "ReplicaProcess",
    "ReplicaStartError",
    "free_port",
    "sim_process",
    "vllm_command",
    "vllm_process",
]


class ReplicaStartError(RuntimeError):
    """A replica process exited or never became healthy; the message ends with its log tail."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ReplicaProcess:
    """One server process with its log file; ready when ``GET <health_path>`` answers 200.

    Used for replicas and, by ``tidal up``, for every other part of the platform too.
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        port: int,
        host: str = "127.0.0.1",
        env: Mapping[str, str] | None = None,
        log_path: str | Path | None = None,
        cwd: str | Path | None = None,
        health_path: str = "/health",
    ) -> None:
        self.name = name
        self.health_path = health_path
        self.argv = list(argv)
        self.port = port
        self.host = host
        self.env = {**os.environ, **(env or {})}
        self.log_path = Path(log_path) if log_path else Path(f"/tmp/tidal-{name}-{port}.log")
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> ReplicaProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        # A new session so that stop() can signal the whole process group (vLLM forks an engine core).
        self.proc = subprocess.Popen(
            self.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=self.cwd,
            start_new_session=True,
        )
        log.close()
        return self

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def healthy(self, timeout: float = 2.0) -> bool:
        try:
            with urllib.request.urlopen(self.url + self.health_path, timeout=timeout) as resp:
                return int(resp.status) == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def wait_ready(self, timeout: float = 180.0, poll: float = 0.5) -> None:
        """Block until healthy; raise :class:`ReplicaStartError` (with the log tail) otherwise."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise ReplicaStartError(
                    f"replica {self.name} exited with code {self.proc.returncode} before becoming healthy; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            if self.healthy():
                return
            time.sleep(poll)
        raise ReplicaStartError(
            f"replica {self.name} not healthy on {self.url} after {timeout:.0f} s; "
            f"log {self.log_path}:\n{self.log_tail()}"
        )

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def send_signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM the process group, then SIGKILL whatever is left after ``timeout``."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGCONT)  # a SIGSTOPped replica cannot handle TERM
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        else:
            # The leader is gone; children of the group may still run.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)


def vllm_command(
    model_dir: str | Path,
    *,
    port: int,
    host: str = "127.0.0.1",
    served_model_name: str = "tiny",
    max_model_len: int = 4096,
    max_loras: int = 2,
    max_lora_rank: int = 8,
    extra_args: Sequence[str] = (),
    python: str | None = None,
) -> list[str]:
    """The command line for vLLM's OpenAI server with the flags Tidal relies on."""
    argv = [
        python or sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        served_model_name,
        "--host",
        host,
        "--port",
        str(port),
        "--max-model-len",
        str(max_model_len),
        "--dtype",
        "bfloat16",
        "--scheduling-policy",
        "priority",
        "--enable-prefix-caching",
    ]
    if max_loras > 0:
        argv += ["--enable-lora", "--max-loras", str(max_loras), "--max-lora-rank", str(max_lora_rank)]
    return argv + list(extra_args)


def vllm_process(
    model_dir: str | Path,
    *,
    port: int | None = None,
    name: str = "vllm",
    kv_cache_gib: int = 1,
    log_path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    **kwargs: object,
) -> ReplicaProcess:
    """A real vLLM replica process (not yet started)."""
    port = port or free_port()
    argv = vllm_command(model_dir, port=port, **kwargs)  # type: ignore[arg-type]
    vllm_env = {
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",
        # Keep each engine to one core so two test replicas share a small machine fairly.
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        **(env or {}),
    }
    return ReplicaProcess(name, argv, port=port, env=vllm_env, log_path=log_path)


def sim_process(
    preset: str,
    *,
    port: int | None = None,
    name: str = "sim",
    args: Sequence[str] = (),
    log_path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
) -> ReplicaProcess:
    """A simulated replica process (``tidal sim``), not yet started."""
    port = port or free_port()
    argv = [sys.executable, "-m", "tidal", "sim", "--preset", preset, "--port", str(port), *args]
    return ReplicaProcess(name, argv, port=port, env=dict(env or {}), log_path=log_path)
