"""Offline evals for the canary controller: the batch tier's ``eval`` job kind, run against one
replica group.

:class:`ReplicaEvalRunner` runs :class:`~batch_jobs.jobs.offline_eval.OfflineEval` itself -- the
same dataset format, request bodies, scorers and report as ``POST /v1/jobs {"kind": "eval"}`` --
but sends its requests straight to the group's replicas (as the gateway lists them) instead of
through the batch queue. So the controller's loop needs no database, broker or workers, and it
evaluates exactly the replicas it weighs: a canary group registered at run time through
``/admin/replicas`` is unknown to the workers' fleet config.

Bounded: at most ``max_items`` dataset items (checked when the runner is made), ``concurrency``
requests in flight, ``request_timeout_s`` per request; an eval in which more than
``max_failed_fraction`` of the items got no answer raises :class:`EvalError` (the controller
then rolls back: an eval it could not run is not a pass).

Example::

    evals = ReplicaEvalRunner(gateway_admin, Path("evals/capitals.jsonl"),
                              models={"interactive": "llama"}, options={"scorer": "exact"})
    ctl = CanaryController(gateway_admin, gateway_admin, pool="interactive", evals=evals,
                           clock=SystemClock())
    await evals.score("interactive", "canary")        # 0.93: the share of items answered right
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from batch_jobs.errors import InvalidRequest
from batch_jobs.jobs.base import Answer, Finished, JobContext, Stage
from batch_jobs.jobs.offline_eval import EvalOptions, OfflineEval
from replicas.client import ReplicaClient
from replicas.errors import ReplicaError
from scheduler.signals import ReplicaView

__all__ = ["EvalError", "ReplicaEvalRunner", "ReplicaListing"]

log = logging.getLogger(__name__)

MAX_ITEMS = 10_000  # the largest eval set a runner accepts, whatever it is given


class ReplicaListing(Protocol):
    """Where the runner finds a group's replicas (a :class:`~scheduler.gateway.GatewayAdmin`)."""

    async def replicas(self) -> list[ReplicaView]: ...


class EvalError(RuntimeError):
    """The eval could not be run or gave no usable score."""


class ReplicaEvalRunner:
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
        self.dataset = Path(dataset)
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

    async def score(self, pool: str, group: str) -> float:
        """The group's score: the share of scored items answered right, in [0, 1]."""
        result = await self.report(pool, group)
        return float(result["score"])

    async def report(self, pool: str, group: str) -> dict[str, Any]:
        """The eval job's summary for the group (``score``, ``ci95``, ``n``, ``failed``, ...)."""
        model = self.models.get(pool)
        if model is None:
            raise EvalError(f"no model known for pool {pool!r}")
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
        n, failed = int(result["n"]), int(result["failed"])
        if result["score"] is None or failed > self.max_failed_fraction * n:
            raise EvalError(f"eval of {pool}/{group}: {failed} of {n} items got no answer")
        log.info(
            "eval %s/%s: score %.4f (%d of %d, %d failed) on %d replica(s)",
            pool,
            group,
            result["score"],
            result["correct"],
            result["scored"],
            failed,
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
