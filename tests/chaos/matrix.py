"""The fault matrix's rows and the clients that measure them.

Each chaos test injects one fault into real processes it started, measures what the clients saw
and records one :class:`Row`: requests sent, failed (the client got an error it can retry on),
retried (by the gateway, invisibly to the client), lost (an answer that ended without its end
and without an error: the client cannot tell it was cut), duplicated, hung (no answer nor error
within the client's timeout), and the time to recover: for interactive rows from the fault to the
end of the last request that failed; for batch rows from the fault to the first line answered
after it (a broker or database restart included); for faults that fail no request (a degraded
link, a cut KV-event stream, Redis lost, a failing actuator) from the fault's end to the state it
broke being whole again, as the row's note says. ``tidal bench chaos`` runs the suite with ``TIDAL_CHAOS_RESULTS`` naming a
file and prints the rows; without it the rows are only printed.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import openai

__all__ = ["Outcome", "Row", "StreamingClients", "record"]

RESULTS_ENV = "TIDAL_CHAOS_RESULTS"


@dataclass
class Row:
    tier: str  # interactive | batch | scheduler
    fault: str
    requests: int
    failed: int
    retried: int
    lost: int
    duplicated: int
    hung: int
    recovery_s: float | None
    note: str = ""
    test: str = ""  # the test that measured it (its pass or fail is the row's verdict)


def record(row: Row) -> Row:
    """Print the row, and append it to the results file when a run collects them."""
    row.test = row.test or os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
    print(f"\nchaos row: {json.dumps(asdict(row))}")
    path = os.environ.get(RESULTS_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(asdict(row)) + "\n")
    return row


@dataclass
class Outcome:
    start: float
    end: float
    kind: str  # ok | failed | lost | hung
    detail: str = ""
    ttft: float | None = None  # seconds from the request to its first token, when one came


@dataclass
class StreamingClients:
    """``workers`` closed-loop streaming chat clients (the ``openai`` SDK, no SDK retries), each
    request with its own id; every outcome kept with its times.

    A request is ``ok`` when its stream ends with a finish reason, ``failed`` when the client got
    an error (HTTP status, an error event, a dropped connection), ``lost`` when the stream ended
    without a finish reason or an error, ``duplicated`` when it carried more tokens than asked
    (``ignore_eos``: exactly ``max_tokens``), ``hung`` when nothing ended it within ``timeout_s``.
    Each outcome keeps its time to first token (``ttft``) when a token came.
    """

    base_url: str
    api_key: str
    workers: int = 8
    max_tokens: int = 64
    timeout_s: float = 20.0
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def _one(self, client: openai.AsyncOpenAI, i: int) -> Outcome:
        t0 = time.monotonic()
        first: float | None = None
        finished = False
        tokens = 0
        try:
            async with asyncio.timeout(self.timeout_s):
                stream = await client.chat.completions.create(
                    model="tiny",
                    messages=[{"role": "user", "content": f"chaos {i} {uuid.uuid4().hex}"}],
                    max_tokens=self.max_tokens,
                    stream=True,
                    extra_body={"ignore_eos": True},
                    extra_headers={"X-Session-Id": f"chaos-{i % self.workers}"},
                )
                async for chunk in stream:
                    if not chunk.choices:
                        continue
                    if chunk.choices[0].delta.content:
                        tokens += 1
                        first = first or time.monotonic() - t0
                    if chunk.choices[0].finish_reason is not None:
                        finished = True
        except TimeoutError:
            return Outcome(t0, time.monotonic(), "hung", ttft=first)
        except (openai.APIError, httpx.HTTPError) as exc:
            return Outcome(t0, time.monotonic(), "failed", f"{type(exc).__name__}: {exc}"[:200], first)
        if tokens > self.max_tokens:  # two generations spliced into one answer
            return Outcome(t0, time.monotonic(), "duplicated", f"{tokens} tokens", first)
        return Outcome(t0, time.monotonic(), "ok" if finished else "lost", ttft=first)

    async def _loop(self, worker: int) -> None:
        client = openai.AsyncOpenAI(
            base_url=self.base_url + "/v1", api_key=self.api_key, max_retries=0, timeout=self.timeout_s + 5
        )
        i = worker
        try:
            while not self._stop.is_set():
                out = await self._one(client, i)
                self.outcomes.append(out)
                i += self.workers
                if out.kind != "ok":
                    await asyncio.sleep(0.1)  # a client backs off a little after an error
        finally:
            await client.close()

    def start(self) -> None:
        self._stop.clear()
        self._tasks = [asyncio.create_task(self._loop(w)) for w in range(self.workers)]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    def count(self, kind: str) -> int:
        return sum(1 for o in self.outcomes if o.kind == kind)

    def row(self, tier: str, fault: str, recovery_s: float | None, note: str = "", retried: int = 0) -> Row:
        """The matrix row of these clients' outcomes."""
        return Row(
            tier=tier,
            fault=fault,
            requests=len(self.outcomes),
            failed=self.count("failed"),
            retried=retried,
            lost=self.count("lost"),
            duplicated=self.count("duplicated"),
            hung=self.count("hung"),
            recovery_s=recovery_s,
            note=note,
        )

    def recovery_s(self, fault_at: float) -> float | None:
        """From the fault to the end of the last request that did not succeed (0 when none)."""
        bad = [o.end for o in self.outcomes if o.kind != "ok" and o.end >= fault_at]
        return max(bad) - fault_at if bad else 0.0

    def summary(self) -> dict[str, Any]:
        kinds: dict[str, int] = {}
        for o in self.outcomes:
            kinds[o.kind] = kinds.get(o.kind, 0) + 1
        details = sorted({o.detail for o in self.outcomes if o.detail})[:5]
        return {"kinds": kinds, "details": details}
