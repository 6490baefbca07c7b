"""Private instances of the services a chaos test breaks: its own RabbitMQ node, its own
PostgreSQL cluster and its own Redis, on their own ports and data directories, so that killing
them never touches the machine's shared ones. RabbitMQ and PostgreSQL run as their packages'
users (neither runs as root); Redis runs as the test's user, without persistence."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.services import in_ci
from tidal.replicas.launcher import free_port

__all__ = [
    "PrivatePostgres",
    "PrivateRabbit",
    "PrivateRedis",
    "private_postgres",
    "private_rabbitmq",
    "private_redis",
    "service_dir",
]


@contextlib.contextmanager
def service_dir() -> Iterator[Path]:
    """A directory the services' own users can reach (pytest's are private to their owner)."""
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="tidal-chaos-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _missing(what: str) -> None:
    import pytest

    if in_ci():
        pytest.fail(f"{what} is needed by the chaos suite under CI", pytrace=False)
    pytest.skip(f"{what} is not installed")


def _wait_port(port: int, timeout: float, what: str, alive: subprocess.Popen[bytes] | None = None) -> None:
    """Until ``port`` accepts connections; fails at once when ``alive`` (the server) has exited."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if alive is not None and alive.poll() is not None:
            raise AssertionError(f"{what} exited with code {alive.returncode} before opening port {port}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.2)
    raise AssertionError(f"{what} did not open port {port} in {timeout:.0f} s")


def _chown(path: Path, user: str) -> None:
    pw = pwd.getpwnam(user)
    for p in [path, *path.rglob("*")]:
        os.chown(p, pw.pw_uid, pw.pw_gid)


@dataclass
class PrivateRabbit:
    root: Path
    port: int
    dist_port: int  # Erlang distribution's own port (a free one: port + 10000 may pass 65535)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    @property
    def node(self) -> str:
        return f"chaos{self.port}@localhost"

    def start(self, timeout: float = 90.0) -> None:
        env = {
            **os.environ,
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_CONFIG_FILE": str(self.root / "rabbitmq.conf"),
            "RABBITMQ_MNESIA_BASE": str(self.root / "mnesia"),
            "RABBITMQ_MNESIA_DIR": str(self.root / "mnesia" / "node"),
            "RABBITMQ_FEATURE_FLAGS_FILE": str(self.root / "feature_flags"),
            "RABBITMQ_LOG_BASE": str(self.root / "log"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.root / "plugins"),
            "RABBITMQ_PID_FILE": str(self.root / "pid"),
        }
        log = (self.root / "server.log").open("ab")
        self.proc = subprocess.Popen(
            ["rabbitmq-server"], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        try:
            _wait_port(self.port, timeout, "the private RabbitMQ node", alive=self.proc)
        except AssertionError as exc:
            tail = (self.root / "server.log").read_text(errors="replace")[-2000:]
            raise AssertionError(f"{exc}; its log ends with:\n{tail}") from None

    def kill(self) -> None:
        """SIGKILL the whole node (its Erlang VM and helpers): a crash, not a stop.

        The VM runs under ``su`` in a session of its own, so it is found by the node name in
        its environment rather than by process group."""
        marker = f"RABBITMQ_NODENAME={self.node}".encode()
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                environ = (proc / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if marker in environ:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(proc.name), signal.SIGKILL)
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
            except OSError:
                return
            time.sleep(0.1)
        raise AssertionError(f"the private RabbitMQ node still listens on {self.port}")


@contextlib.contextmanager
def private_rabbitmq(tmp: Path) -> Iterator[PrivateRabbit]:
    if shutil.which("rabbitmq-server") is None:
        _missing("rabbitmq-server")
    root = tmp / "rabbitmq"
    for d in ("mnesia", "log"):
        (root / d).mkdir(parents=True, exist_ok=True)
    port = free_port()
    (root / "rabbitmq.conf").write_text(f"listeners.tcp.local = 127.0.0.1:{port}\n")
    (root / "plugins").write_text("")
    if os.geteuid() == 0:
        _chown(root, "rabbitmq")
    rabbit = PrivateRabbit(root, port, free_port())
    try:  # a node that fails to start is killed too
        rabbit.start()
        yield rabbit
    finally:
        rabbit.kill()


@dataclass
class PrivatePostgres:
    data: Path
    port: int
    bin: Path

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _ctl(self, *args: str) -> None:
        cmd = [str(self.bin / "pg_ctl"), "-D", str(self.data), *args]
        if os.geteuid() == 0:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)

    def start(self) -> None:
        self._ctl(
            "-l", str(self.data.parent / "postgres.log"), "-w", "-o", f"-p {self.port} -k /tmp", "start"
        )

    def restart_immediately(self) -> None:
        """Stop with ``immediate`` (no checkpoint: crash recovery on start), then start."""
        self._ctl("-m", "immediate", "-w", "stop")
        self.start()

    def stop(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError, subprocess.TimeoutExpired):
            self._ctl("-m", "fast", "-w", "stop")


def _pg_bin() -> Path | None:
    for candidate in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (candidate / "initdb").exists():
            return candidate
    found = shutil.which("initdb")
    return Path(found).parent if found else None


@contextlib.contextmanager
def private_postgres(tmp: Path) -> Iterator[PrivatePostgres]:
    bindir = _pg_bin()
    if bindir is None:
        _missing("PostgreSQL's initdb")
        raise AssertionError("unreachable")
    root = tmp / "postgres"
    data = root / "data"
    data.mkdir(parents=True)
    if os.geteuid() == 0:
        _chown(root, "postgres")
    init = [str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8"]
    if os.geteuid() == 0:
        init = ["runuser", "-u", "postgres", "--", *init]
    subprocess.run(init, check=True, capture_output=True, timeout=120)
    pg = PrivatePostgres(data, free_port(), bindir)
    try:
        pg.start()
        yield pg
    finally:
        pg.stop()


@dataclass
class PrivateRedis:
    """A ``redis-server`` on its own port, without persistence (``--save ''``, no AOF): restarted,
    it comes back empty, as a cache node that lost its memory does."""

    root: Path
    port: int
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 15.0) -> None:
        exe = shutil.which("redis-server")
        assert exe is not None
        argv = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.root)]
        argv += ["--save", "", "--appendonly", "no"]
        log = (self.root / "redis.log").open("ab")
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        _wait_port(self.port, timeout, "the private Redis", alive=self.proc)

    def kill(self) -> None:
        """SIGKILL: a crash, the clients' connections reset, no goodbye."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)


@contextlib.contextmanager
def private_redis(tmp: Path) -> Iterator[PrivateRedis]:
    if shutil.which("redis-server") is None:
        _missing("redis-server")
    root = tmp / "redis"
    root.mkdir(parents=True, exist_ok=True)
    redis = PrivateRedis(root, free_port())
    try:
        redis.start()
        yield redis
    finally:
        redis.kill()
