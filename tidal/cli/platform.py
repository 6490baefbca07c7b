"""The whole platform as one child process: ``tidal up`` on a fleet file, its own ports, its own
queues. ``tidal demo`` and the mixed soak run on it.

Example::

    with local_platform(Path("fleet.yaml"), Path("/tmp/run")) as p:
        openai.OpenAI(base_url=p.url + "/v1", api_key=p.key).models.list()
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["LocalPlatform", "embedded_fleet", "local_platform"]

ROOT = Path(__file__).resolve().parents[2]

# How each part's command line reads (Celery retitles the worker's process).
_PARTS = {
    "gateway": (b"tidal gateway ",),
    "worker": (b"tidal worker ", b"celeryd"),
    "scheduler": (b"tidal scheduler ",),
}


@dataclass(frozen=True)
class LocalPlatform:
    """A running ``tidal up``: where its parts answer and the keys to use."""

    url: str  # the gateway, without /v1
    key: str  # the development tenant's API key
    admin_key: str
    scheduler_url: str
    worker_metrics_url: str
    flower_url: str
    data_dir: Path
    fleet_path: Path
    proc: subprocess.Popen[bytes]

    def pids(self) -> dict[str, int]:
        """The gateway's, the worker's and the scheduler's process ids (``tidal up``'s children)."""
        out: dict[str, int] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError, ValueError, IndexError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if ppid != self.proc.pid:
                    continue
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
                for part, marks in _PARTS.items():
                    if any(m in cmd for m in marks):
                        out[part] = int(entry.name)
        return out


def embedded_fleet() -> dict[str, Any]:
    """The embedded fleet as data, to run a copy of it beside anything: every loopback port it
    names (replicas, KV events, the provider's stand-in) moved to a free one, and the files it
    names by relative path (the eval set) made absolute, so the copy can be written anywhere."""
    import yaml

    from tidal.defaults import DEFAULT_FLEET_PATH
    from tidal.replicas.launcher import free_port

    text = DEFAULT_FLEET_PATH.read_text()
    for old in sorted(set(re.findall(r"127\.0\.0\.1:(8[1-3]\d\d)\b", text))):
        text = text.replace(f"127.0.0.1:{old}", f"127.0.0.1:{free_port()}")
    data: dict[str, Any] = yaml.safe_load(text)

    def absolute(spec: dict[str, Any], key: str) -> None:
        if spec.get(key):
            spec[key] = str((DEFAULT_FLEET_PATH.parent / spec[key]).resolve())

    for pool in data["pools"].values():
        for replica in pool.get("replicas", []):
            absolute(replica.get("launch") or {}, "answer_key")
        absolute((pool.get("canary") or {}).get("eval") or {}, "dataset")
    absolute((data.get("external_provider") or {}).get("launch") or {}, "answer_key")
    return data


@contextlib.contextmanager
def local_platform(
    fleet_path: Path,
    workdir: Path,
    *,
    log: Callable[[str], None] = print,
    env: Mapping[str, str] | None = None,
    ready_timeout_s: float = 300.0,
) -> Iterator[LocalPlatform]:
    """Start ``tidal up`` on ``fleet_path`` (its replicas on the ports it names; the gateway,
    scheduler, worker metrics and Flower on free ones), data and logs under ``workdir``, queues
    of its own on the broker; stop it (Ctrl-C, then kill) on leaving."""
    from tidal.replicas.launcher import free_port

    port, scheduler_port, worker_port, flower_port = (free_port() for _ in range(4))
    key = f"tidal-{secrets.token_urlsafe(16)}"
    admin_key = f"tidal-admin-{secrets.token_urlsafe(16)}"
    data_dir = workdir / "data"
    full_env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
        "TIDAL_ADMIN_KEY": admin_key,
        "TIDAL_QUEUE_NAMESPACE": f"tidal-{secrets.token_hex(4)}",
        "TIDAL_DATA_DIR": str(data_dir),
        **(env or {}),
    }
    for var in ("TIDAL_DATABASE_URL", "TIDAL_FILES_DIR", "TIDAL_FLEET_CONFIG"):
        full_env.pop(var, None)  # the platform's own store, under the data dir
    argv = [sys.executable, "-m", "tidal", "up", "--config", str(fleet_path), "--port", str(port)]
    argv += ["--api-key", key, "--data-dir", str(data_dir), "--scheduler-port", str(scheduler_port)]
    argv += ["--flower-port", str(flower_port), "--worker-metrics-port", str(worker_port)]
    up_log = workdir / "up.log"
    workdir.mkdir(parents=True, exist_ok=True)
    with up_log.open("wb") as out:
        proc = subprocess.Popen(
            argv, env=full_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + ready_timeout_s
        while b"Ready." not in up_log.read_bytes():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"tidal up did not start:\n{up_log.read_text()[-3000:]}")
            time.sleep(0.5)
        log(f"tidal up is ready (logs in {data_dir / 'logs'})")
        yield LocalPlatform(
            url=f"http://127.0.0.1:{port}",
            key=key,
            admin_key=admin_key,
            scheduler_url=f"http://127.0.0.1:{scheduler_port}",
            worker_metrics_url=f"http://127.0.0.1:{worker_port}",
            flower_url=f"http://127.0.0.1:{flower_port}",
            data_dir=data_dir,
            fleet_path=fleet_path,
            proc=proc,
        )
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)  # tidal up stops its parts in order
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
