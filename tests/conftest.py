"""Shared fixtures: the async backend, real vLLM CPU replicas, and service checks."""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.services import require_module

pytest_plugins = ["anyio"]


@pytest.fixture
def anyio_backend() -> str:
    # aiohttp (the replica client) runs on asyncio only.
    return "asyncio"


# -- real vLLM on the CPU ---------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with two LoRA adapters, built once per session (cached across runs)."""
    require_module("vllm", "install the `vllm` extra: scripts/setup")
    cache = Path(os.environ.get("TIDAL_TEST_CACHE", Path.home() / ".cache" / "tidal-tests")) / "tiny"
    from tidal.replicas.tiny_model import build_tiny_model

    build_tiny_model(cache, adapters=2)
    return cache


class VLLMFactory:
    """Starts real vLLM CPU replicas for tests and stops them all at the end of the session."""

    def __init__(self, model_root: Path, log_dir: Path) -> None:
        self.model_root = model_root
        self.log_dir = log_dir
        self._procs: list[object] = []

    def start(
        self,
        count: int = 1,
        *,
        extra_args: tuple[str, ...] = (),
        max_loras: int = 2,
        timeout: float = 300.0,
        env: dict[str, str] | None = None,
        kv_events: bool = False,
    ) -> list:  # type: ignore[type-arg]
        from tidal.replicas.launcher import vllm_process

        procs = []
        for _ in range(count):
            p = vllm_process(
                self.model_root / "model",
                name=f"vllm-test-{len(self._procs)}",
                log_path=self.log_dir / f"vllm-{len(self._procs)}.log",
                max_loras=max_loras,
                extra_args=extra_args,
                kv_cache_gib=1,
                env=env,
                kv_events=kv_events,
            )
            self._procs.append(p)
            procs.append(p.start())
        # Start together, wait together: the engines load in parallel.
        with ThreadPoolExecutor(max_workers=count) as pool:
            list(pool.map(lambda p: p.wait_ready(timeout), procs))
        return procs

    def stop_all(self) -> None:
        for p in self._procs:
            p.stop()  # type: ignore[attr-defined]


@pytest.fixture(scope="session")
def vllm_factory(tiny_model_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMFactory]:
    factory = VLLMFactory(tiny_model_root, tmp_path_factory.mktemp("vllm-logs"))
    yield factory
    factory.stop_all()


@pytest.fixture(scope="session")
def vllm_pair(vllm_factory: VLLMFactory) -> list:  # type: ignore[type-arg]
    """Two real vLLM CPU replicas (served model `tiny`, LoRA enabled) shared by the whole session.

    Tests must not kill or pause these; use ``vllm_factory.start()`` for a replica of your own.
    """
    return vllm_factory.start(2)


@pytest.fixture(scope="session")
def vllm_urls(request: pytest.FixtureRequest) -> list[str]:
    """The URLs of ``vllm_pair``, or of replicas already running given by ``TIDAL_TEST_VLLM_URLS``
    (comma-separated), for quick local iterations. Shared: never kill or pause them."""
    given = os.environ.get("TIDAL_TEST_VLLM_URLS")
    if given:
        return [u.strip() for u in given.split(",") if u.strip()]
    return [p.url for p in request.getfixturevalue("vllm_pair")]


@pytest.fixture(scope="session")
def vllm_replica(vllm_pair: list) -> object:  # type: ignore[type-arg]
    return vllm_pair[0]
