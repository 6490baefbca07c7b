"""Real replicas and a real gateway for the scheduler's end-to-end tests.

Example::

    with sim_replicas(tmp_path, {"stable": ["--accuracy", "1.0"]}) as sims, \\
         run_gateway(tmp_path, fleet_dict([sims["stable"].url])) as gw:
        async with GatewayAdmin([gw.url], admin_key=ADMIN_KEY) as admin:
            ...
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import openai

from tests.api.harness import DEV_KEY, Gateway
from tidal.replicas.launcher import ReplicaProcess, sim_process

__all__ = ["Traffic", "sim_replicas"]


def write_eval_files(directory: Path, items: Sequence[tuple[str, str]]) -> tuple[Path, Path]:
    """An eval set (``prompt``/``reference``) and the simulator's answer key for it."""
    dataset, key = directory / "eval.jsonl", directory / "answers.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": p, "reference": a}) + "\n" for p, a in items))
    key.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in items))
    return dataset, key


@contextlib.contextmanager
def sim_replicas(log_dir: Path, args: Mapping[str, Sequence[str]]) -> Iterator[dict[str, ReplicaProcess]]:
    """``tidal sim`` replicas serving ``tiny`` (preset fast-test), one per name, started together."""
    procs = {
        name: sim_process(
            "fast-test",
            name=name,
            args=["--served-model-name", "tiny", *extra],
            log_path=log_dir / f"sim-{name}.log",
        )
        for name, extra in args.items()
    }
    try:
        for p in procs.values():
            p.start()
        for p in procs.values():
            p.wait_ready(60)
        yield procs
    finally:
        for p in procs.values():
            p.stop()


class Traffic:
    """Chat requests through the gateway with the ``openai`` SDK, ``workers`` at a time, until
    stopped; counts what the clients saw (the SDK does not retry: ``max_retries=0``)."""

    def __init__(self, gw: Gateway, prompts: Sequence[str], *, workers: int = 4, max_tokens: int = 4) -> None:
        self.client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=DEV_KEY, max_retries=0, timeout=30)
        self.prompts = list(prompts)
        self.workers = workers
        self.max_tokens = max_tokens
        self.ok = 0
        self.failed: list[str] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def _loop(self, worker: int) -> None:
        i = worker
        while not self._stop.is_set():
            prompt = self.prompts[i % len(self.prompts)]
            i += self.workers
            try:
                await self.client.chat.completions.create(
                    model="tiny",
                    messages=[{"role": "user", "content": prompt}],
                    max_tokens=self.max_tokens,
                    extra_headers={"X-Session-Id": f"traffic-{i}"},
                )
                self.ok += 1
            except openai.APIError as exc:
                self.failed.append(f"{type(exc).__name__}: {exc}")

    async def send(self, n: int) -> None:
        """``n`` requests, ``workers`` at a time, then return."""
        before = self.ok + len(self.failed)
        self.start()
        while self.ok + len(self.failed) - before < n:
            await asyncio.sleep(0.02)
        await self.stop()

    def start(self) -> None:
        self._stop.clear()
        self._tasks = [asyncio.create_task(self._loop(w)) for w in range(self.workers)]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        self._tasks = []

    async def aclose(self) -> None:
        await self.stop()
        await self.client.close()
