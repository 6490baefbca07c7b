"""Start replicas as local processes: real vLLM (CPU or GPU) or the simulated replica.

Example::

    proc = vllm_process("/tmp/tiny/model", port=8001, served_model_name="tiny")
    proc.start()
    proc.wait_ready(timeout=180)      # raises ReplicaStartError with the log tail on failure
    ...
    proc.stop()

Used by ``tidal replica vllm``, ``tidal up``, the local-process autoscaler actuator and the test
fixtures.

``kv_events`` turns on KV-cache events (vLLM's ``--kv-events-config``; the simulator's same flag):
``True`` picks two free ports (PUB and replay), as ``port=None`` does for HTTP; a
:class:`~replicas.wire.kv_events.KVEventsConfig` is passed as given. The process's
:attr:`ReplicaProcess.kv_events` then says where to subscribe. vLLM binds its PUB socket only on
a wildcard address (``tcp://*:PORT``, every interface): the events carry prompt token ids, so keep
those ports on a private network.
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path

from tidal.replicas.wire.kv_events import KVEventsConfig, connect_address

__all__ = [
    "ReplicaProcess",
    "ReplicaStartError",
    "free_port",
    "kv_events_config",
    "sim_process",
    "vllm_command",
    "vllm_process",
]


class ReplicaStartError(RuntimeError):
    """A replica process exited or never became healthy; the message ends with its log tail."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, below the kernel's ephemeral
    range. A port the kernel picks (binding port 0) comes from the range it also gives the local
    ends of outgoing connections: between this call and the server's bind, a connection made
    meanwhile (a platform starting opens hundreds) could take it, and the server failed with
    "Address already in use". Ports handed out lately are not handed out again."""
    low = _ephemeral_low()
    span = min(16384, low - 1024)
    for _ in range(256):
        port = low - 1 - secrets.randbelow(span)
        if port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN.append(port)
        return port
    with socket.socket() as s:  # (that range is full: the kernel's pick, as before)
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_GIVEN: deque[int] = deque(maxlen=256)  # ports free_port handed out lately


@functools.cache
def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (Linux; 32768, its default, elsewhere)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
    return low if low > 4096 else 32768


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
        self.kv_events: KVEventsConfig | None = None  # what it publishes, when it does

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def kv_events_addresses(self) -> tuple[str, str | None]:
        """Where a subscriber on this host connects: (PUB address, replay address)."""
        cfg = self.kv_events
        if cfg is None:
            raise ValueError(f"replica {self.name} publishes no KV events")
        replay = connect_address(cfg.replay_endpoint, self.host) if cfg.replay_endpoint else None
        return connect_address(cfg.endpoint, self.host), replay

    def kv_events_spec(self) -> dict[str, str | None] | None:
        """Where a gateway follows this replica's KV events, in the shape of a fleet replica's
        ``kv_events`` and of ``POST /admin/replicas`` (``endpoint``, ``replay_endpoint``,
        ``topic``); ``None`` when it publishes none."""
        if self.kv_events is None:
            return None
        endpoint, replay = self.kv_events_addresses()
        return {"endpoint": endpoint, "replay_endpoint": replay, "topic": self.kv_events.topic}

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


def kv_events_config(
    port: int | None = None, replay_port: int | None = None, *, topic: str = "", host: str = "*"
) -> KVEventsConfig:
    """KV events on ``tcp://*:port`` (PUB: vLLM binds only wildcard addresses) with replay on
    ``tcp://host:replay_port``; a port of ``None`` is a free one."""
    replay_host = "*" if host in ("0.0.0.0", "::") else host
    return KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=f"tcp://*:{port or free_port()}",
        replay_endpoint=f"tcp://{replay_host}:{replay_port or free_port()}",
        topic=topic,
    )


def _kv_events(value: bool | KVEventsConfig, host: str) -> KVEventsConfig | None:
    if isinstance(value, KVEventsConfig):
        return value
    return kv_events_config(host=host) if value else None


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
    kv_events: KVEventsConfig | None = None,
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
    if kv_events is not None:
        argv += ["--kv-events-config", kv_events.to_json()]
    return argv + list(extra_args)


_VLLM_SITE = Path(__file__).resolve().parent / "vllm_site"


def vllm_process(
    model_dir: str | Path,
    *,
    port: int | None = None,
    name: str = "vllm",
    kv_cache_gib: int = 1,
    log_path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    kv_events: bool | KVEventsConfig = False,
    **kwargs: object,
) -> ReplicaProcess:
    """A real vLLM replica process (not yet started)."""
    port = port or free_port()
    host = str(kwargs.get("host", "127.0.0.1"))
    kv = _kv_events(kv_events, host)
    argv = vllm_command(model_dir, port=port, kv_events=kv, **kwargs)  # type: ignore[arg-type]
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
    # Every process of the replica asks for the AMX tile state first (see the module there).
    vllm_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(_VLLM_SITE), vllm_env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))) if p
    )
    proc = ReplicaProcess(name, argv, port=port, env=vllm_env, log_path=log_path)
    proc.kv_events = kv
    return proc


def sim_process(
    preset: str,
    *,
    port: int | None = None,
    name: str = "sim",
    args: Sequence[str] = (),
    log_path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    kv_events: bool | KVEventsConfig = False,
) -> ReplicaProcess:
    """A simulated replica process (``tidal sim``), not yet started."""
    port = port or free_port()
    kv = _kv_events(kv_events, "127.0.0.1")
    argv = [sys.executable, "-m", "tidal", "sim", "--preset", preset, "--port", str(port)]
    if kv is not None:
        argv += ["--kv-events-config", kv.to_json()]
    proc = ReplicaProcess(name, [*argv, *args], port=port, env=dict(env or {}), log_path=log_path)
    proc.kv_events = kv
    return proc
