"""Offline evals for the canary controller: the batch tier's ``eval`` job kind, run against one
replica group, in one of two ways.

:class:`JobEvalRunner` goes through the product: it uploads the eval set to the gateway
(``POST /v1/files``), starts an ``eval`` job pinned to the pool and group (``POST /v1/jobs``,
admin key), waits for it and reads its score. The batch tier must be running, and the workers
must know the group's replicas: listed in the fleet file, or registered with a gateway that
shares their store (``POST /admin/replicas`` records them there).

:class:`ReplicaEvalRunner` runs :class:`~batch_jobs.jobs.offline_eval.OfflineEval` itself -- the
same dataset format, request bodies, scorers and report as ``POST /v1/jobs {"kind": "eval"}`` --
but sends its requests straight to the group's replicas (as the gateway lists them) instead of
through the batch queue. So the controller's loop needs no database, broker or workers, and it
evaluates exactly the replicas it weighs, whatever store (if any) the gateway uses.

Bounded: at most ``max_items`` dataset items (checked when the runner is made), ``concurrency``
requests in flight, ``request_timeout_s`` per request; an eval in which more than
``max_failed_fraction`` of the items got no answer raises :class:`EvalError` (the controller
then rolls back: an eval it could not run is not a pass).

Example::

    evals = JobEvalRunner("http://127.0.0.1:8000", admin_key=key, dataset=Path("evals/capitals.jsonl"),
                          models={"interactive": "llama"}, options={"scorer": "exact"})
    evals = ReplicaEvalRunner(gateway_admin, Path("evals/capitals.jsonl"),
                              models={"interactive": "llama"}, options={"scorer": "exact"})
    ctl = CanaryController(gateway_admin, gateway_admin, pool="interactive", evals=evals,
                           clock=SystemClock())
    await evals.score("interactive", "canary")        # 0.93: the share of items answered right
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote

import aiohttp

from tidal.batch_jobs.errors import InvalidRequest
from tidal.batch_jobs.jobs.base import Answer, Finished, JobContext, Stage
from tidal.batch_jobs.jobs.offline_eval import EvalOptions, OfflineEval
from tidal.replicas.client import ReplicaClient
from tidal.replicas.errors import ReplicaError
from tidal.scheduler.signals import ReplicaView

__all__ = ["EvalError", "JobEvalRunner", "ReplicaEvalRunner", "ReplicaListing"]

log = logging.getLogger(__name__)

MAX_ITEMS = 10_000  # the largest eval set a runner accepts, whatever it is given
MAX_DATASET_BYTES = 64 * 1024 * 1024
_MAX_ANSWER = 1024 * 1024  # a jobs API answer larger than this is refused


def _check_size(dataset: Path) -> Path:
    size = dataset.stat().st_size
    if size > MAX_DATASET_BYTES:
        raise ValueError(f"eval dataset {dataset.name} has {size} bytes, more than {MAX_DATASET_BYTES}")
    return dataset


def _check_answered(result: Mapping[str, Any], max_failed_fraction: float, what: str) -> None:
    """An eval where too many items got no answer has no score worth comparing."""
    n, failed = int(result["n"]), int(result["failed"])
    if result.get("score") is None or failed > max_failed_fraction * n:
        raise EvalError(f"{what}: {failed} of {n} items got no answer")


class ReplicaListing(Protocol):
    """Where the runner finds a group's replicas (a :class:`~scheduler.gateway.GatewayAdmin`)."""

    async def replicas(self) -> list[ReplicaView]: ...


class EvalError(RuntimeError):
    """The eval could not be run or gave no usable score."""


class _Runner:
    """What both runners share: the model each pool serves, and the score from the report."""

    models: dict[str, str]

    async def report(self, pool: str, group: str) -> dict[str, Any]:
        raise NotImplementedError

    async def score(self, pool: str, group: str) -> float:
        """The group's score: the share of scored items answered right, in [0, 1]."""
        result = await self.report(pool, group)
        return float(result["score"])

    def _model(self, pool: str) -> str:
        model = self.models.get(pool)
        if model is None:
            raise EvalError(f"no model known for pool {pool!r}")
        return model


class ReplicaEvalRunner(_Runner):
    """The ``eval`` job kind against one group's replicas, directly (see the module docstring).

    **Parameters:** ``registry`` -- where the replicas are listed (the gateway's admin API);
    ``dataset`` -- the eval set, JSONL as for the ``eval`` job kind; ``models`` -- the served
    model name per pool; ``options`` -- the eval job's options (``scorer``, ``max_tokens``, ...;
    not ``judge``: a judge model would have to be served outside the groups under test);
    ``max_items``, ``concurrency``, ``request_timeout_s``, ``max_failed_fraction`` -- the bounds.
    """

    kind = OfflineEval()

    def __init__(
        self,
        registry: ReplicaListing,
        dataset: Path,
        *,
        models: Mapping[str, str],
        options: Mapping[str, Any] | None = None,
        max_items: int = 1000,
        concurrency: int = 8,
        request_timeout_s: float = 30.0,
        max_failed_fraction: float = 0.5,
        api_key: str | None = None,
    ) -> None:
        if not 1 <= max_items <= MAX_ITEMS:
            raise ValueError(f"max_items must be within [1, {MAX_ITEMS}]")
        if concurrency < 1 or request_timeout_s <= 0 or not 0.0 <= max_failed_fraction <= 1.0:
            raise ValueError("concurrency >= 1, request_timeout_s > 0 and max_failed_fraction in [0, 1]")
        self.registry = registry
        self.dataset = _check_size(Path(dataset))
        self.models = dict(models)
        self.options = dict(options or {})
        if "pool" in self.options or "replica_group" in self.options:
            raise ValueError("the pool and group come from score(pool, group), not from the options")
        self.max_items = max_items
        self.concurrency = concurrency
        self.request_timeout_s = request_timeout_s
        self.max_failed_fraction = max_failed_fraction
        self.api_key = api_key
        # Refuse a bad dataset or bad options now, not at the first rollout.
        parsed = self._options(pool="-", group="-")
        if parsed.scorer == "judge":
            raise ValueError(
                "the judge scorer is not supported here: run the eval job through the batch tier"
            )
        try:
            self.kind.start(self._context("-", parsed))
        except InvalidRequest as exc:
            raise ValueError(f"eval dataset {self.dataset.name}: {exc}") from None

    def _options(self, *, pool: str, group: str) -> EvalOptions:
        try:
            parsed = self.kind.parse_options({**self.options, "pool": pool, "replica_group": group})
        except InvalidRequest as exc:
            raise ValueError(str(exc)) from None
        assert isinstance(parsed, EvalOptions)
        return parsed

    def _context(self, model: str, options: EvalOptions) -> JobContext:
        return JobContext(
            job_id="canary-eval",
            model=model,
            options=options,
            dataset=self.dataset,
            state={},
            context_cap=0,  # the eval kind does not cut prompts to the context
            max_items=self.max_items,
        )

    async def report(self, pool: str, group: str) -> dict[str, Any]:
        """The eval job's summary for the group (``score``, ``ci95``, ``n``, ``failed``, ...)."""
        model = self._model(pool)
        replicas = [
            v
            for v in await self.registry.replicas()
            if v.pool == pool and v.group == group and v.healthy and not v.draining
        ]
        if not replicas:
            raise EvalError(f"pool {pool!r} has no healthy replica in group {group!r}")
        ctx = self._context(model, self._options(pool=pool, group=group))
        clients = {
            v.url: ReplicaClient(
                v.url,
                api_key=self.api_key,
                pool_size=self.concurrency,
                connect_timeout=min(3.0, self.request_timeout_s),
                read_timeout=self.request_timeout_s,
                name=v.name,
            )
            for v in replicas
        }
        try:
            step: Stage | Finished = self.kind.start(ctx)
            while isinstance(step, Stage):
                answers = await self._run_stage(step, replicas, clients)
                step = self.kind.advance(ctx, answers)
        finally:
            await asyncio.gather(*(c.aclose() for c in clients.values()))
        result = step.result
        _check_answered(result, self.max_failed_fraction, f"eval of {pool}/{group}")
        log.info(
            "eval %s/%s: score %.4f (%d of %d, %d failed) on %d replica(s)",
            pool,
            group,
            result["score"],
            result["correct"],
            result["scored"],
            result["failed"],
            len(replicas),
        )
        return result

    async def _run_stage(
        self, stage: Stage, replicas: list[ReplicaView], clients: Mapping[str, ReplicaClient]
    ) -> dict[str, Answer]:
        if stage.endpoint != "/v1/chat/completions":
            raise EvalError(f"cannot send eval requests to {stage.endpoint}")
        sem = asyncio.Semaphore(self.concurrency)
        turn = itertools.cycle(replicas)  # round robin: every replica of the group is evaluated

        async def one(line: dict[str, Any], replica: ReplicaView) -> Answer:
            async with sem:
                try:
                    body = await asyncio.wait_for(
                        clients[replica.url].chat_completions(line["body"], timeout=self.request_timeout_s),
                        self.request_timeout_s,
                    )
                except (ReplicaError, TimeoutError) as exc:
                    return Answer(line["custom_id"], False, None, f"{type(exc).__name__}: {exc}")
                return Answer(line["custom_id"], True, body, None)

        answers = await asyncio.gather(*(one(line, next(turn)) for line in stage.lines))
        return {a.custom_id: a for a in answers}


class JobEvalRunner(_Runner):
    """The eval as a job of the batch tier, through the gateway's jobs API (see the module docstring).

    **Parameters:** ``gateway_url`` -- the gateway (http/https) the scheduler was configured with;
    ``admin_key`` -- only admins may pin a job to a pool or group; ``dataset`` -- the eval set
    (uploaded once, with purpose ``evals``); ``models`` -- the served model name per pool;
    ``options`` -- the job's options besides ``pool`` and ``replica_group``; ``poll_s`` -- how
    often the job is read; ``timeout_s`` -- a job still running then is cancelled and the eval
    fails; ``max_failed_fraction`` -- as for :class:`ReplicaEvalRunner`.
    """

    def __init__(
        self,
        gateway_url: str,
        *,
        admin_key: str,
        dataset: Path,
        models: Mapping[str, str],
        options: Mapping[str, Any] | None = None,
        poll_s: float = 2.0,
        timeout_s: float = 3600.0,
        call_timeout_s: float = 30.0,
        max_failed_fraction: float = 0.5,
    ) -> None:
        if not gateway_url.startswith(("http://", "https://")):
            raise ValueError(f"gateway URL must be http(s)://..., got {gateway_url!r}")
        if poll_s <= 0 or timeout_s <= 0 or call_timeout_s <= 0 or not 0.0 <= max_failed_fraction <= 1.0:
            raise ValueError("poll_s, timeout_s, call_timeout_s > 0 and max_failed_fraction in [0, 1]")
        self.base_url = gateway_url.rstrip("/")
        self.dataset = _check_size(Path(dataset))
        self.models = dict(models)
        self.options = dict(options or {})
        if "pool" in self.options or "replica_group" in self.options:
            raise ValueError("the pool and group come from score(pool, group), not from the options")
        try:
            OfflineEval().parse_options(self.options)  # refuse bad options now (the gateway checks again)
        except InvalidRequest as exc:
            raise ValueError(str(exc)) from None
        self.poll_s = poll_s
        self.timeout_s = timeout_s
        self.max_failed_fraction = max_failed_fraction
        self._headers = {"Authorization": f"Bearer {admin_key}"}
        self._timeout = aiohttp.ClientTimeout(total=call_timeout_s)
        self._file_id: str | None = None
        self._upload_lock = asyncio.Lock()

    async def _call(
        self, session: aiohttp.ClientSession, method: str, path: str, **kw: Any
    ) -> dict[str, Any]:
        url = self.base_url + path
        try:
            async with session.request(method, url, headers=self._headers, **kw) as resp:
                raw = await resp.content.read(_MAX_ANSWER + 1)
                if len(raw) > _MAX_ANSWER:
                    raise EvalError(f"{method} {path}: answer larger than {_MAX_ANSWER} bytes")
                try:
                    body = json.loads(raw) if raw else {}
                except ValueError:
                    body = {}
                if resp.status >= 400:
                    err = body.get("error") if isinstance(body, dict) else None
                    msg = err.get("message") if isinstance(err, dict) else raw[:300].decode(errors="replace")
                    raise EvalError(f"{method} {path}: HTTP {resp.status}: {msg}")
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise EvalError(f"{method} {path}: {exc!r}") from exc
        if not isinstance(body, dict):
            raise EvalError(f"{method} {path}: expected a JSON object")
        return body

    async def _upload(self, session: aiohttp.ClientSession) -> str:
        async with self._upload_lock:  # both groups' evals start together: upload once
            if self._file_id is None:
                form = aiohttp.FormData()
                form.add_field("purpose", "evals")
                form.add_field("file", self.dataset.read_bytes(), filename=self.dataset.name)
                self._file_id = str((await self._call(session, "POST", "/v1/files", data=form))["id"])
            return self._file_id

    async def report(self, pool: str, group: str) -> dict[str, Any]:
        """The finished job's ``result`` (``score``, ``ci95``, ``n``, ``failed``, ...)."""
        model = self._model(pool)
        async with aiohttp.ClientSession(timeout=self._timeout) as session:
            file_id = await self._upload(session)
            body = {
                "kind": "eval",
                "input_file_id": file_id,
                "model": model,
                "options": {**self.options, "pool": pool, "replica_group": group},
                "metadata": {"purpose": "canary", "pool": pool[:100], "group": group[:100]},
            }
            job = await self._call(session, "POST", "/v1/jobs", json=body)
            path = f"/v1/jobs/{quote(str(job['id']), safe='')}"
            deadline = time.monotonic() + self.timeout_s
            try:
                while job.get("status") == "in_progress":
                    if time.monotonic() > deadline:
                        raise EvalError(
                            f"eval job {job['id']} of {pool}/{group} still running after {self.timeout_s:g} s"
                        )
                    await asyncio.sleep(self.poll_s)
                    job = await self._call(session, "GET", path)
            except BaseException:
                if job.get("status") == "in_progress":  # do not leave it running for nobody
                    with contextlib.suppress(EvalError):
                        await self._call(session, "POST", path + "/cancel")
                raise
        result = job.get("result")
        if job.get("status") != "completed" or not isinstance(result, dict):
            raise EvalError(f"eval job {job['id']} of {pool}/{group} {job.get('status')}: {job.get('error')}")
        _check_answered(result, self.max_failed_fraction, f"eval job {job['id']} of {pool}/{group}")
        log.info("eval job %s of %s/%s: score %.4f", job["id"], pool, group, result["score"])
        return result
