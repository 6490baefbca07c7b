"""What a job kind is: it compiles a dataset into batch lines (one or more stages) and turns the
answers into its outputs.

A kind is a small class registered in :data:`batch_jobs.jobs.KINDS`::

    class MyKind(JobKind):
        name = "my_kind"
        Options = MyOptions                       # pydantic model, strict
        def start(self, ctx) -> Stage: ...        # the first batch
        def advance(self, ctx, answers) -> Stage | Finished: ...
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from tidal.batch_jobs.errors import InvalidRequest
from tidal.batch_jobs.files import Readable

__all__ = [
    "Answer",
    "Finished",
    "JobContext",
    "JobKind",
    "JobOptions",
    "OutputFile",
    "Stage",
    "read_dataset",
]

MAX_REPORTED = 20


class JobOptions(BaseModel):
    """Options every kind accepts: where and how urgently its batches run."""

    model_config = ConfigDict(extra="forbid")

    priority: int = Field(default=0, ge=0, le=9)
    lane: str = Field(default="any", pattern="^(reserved|spot|any)$")
    # Run against one pool or replica group (e.g. a canary build) -- admins only.
    pool: str | None = Field(default=None, max_length=128)
    replica_group: str | None = Field(default=None, max_length=128)
    # The feature its batches run under (its regions bound where); resolved as a batch's.
    feature: str | None = Field(default=None, max_length=128)


@dataclass(frozen=True)
class Stage:
    """One batch to run: lines for ``endpoint``, each ``{"custom_id": ..., "body": {...}}``."""

    endpoint: str
    lines: list[dict[str, Any]]
    name: str = ""


@dataclass(frozen=True)
class OutputFile:
    filename: str
    content: bytes


@dataclass(frozen=True)
class Finished:
    """The job's summary (shown on ``GET /v1/jobs/{id}``) and its output files by name."""

    result: dict[str, Any]
    outputs: dict[str, OutputFile] = field(default_factory=dict)


@dataclass(frozen=True)
class Answer:
    """One answered (or failed) line of a stage."""

    custom_id: str
    ok: bool
    body: dict[str, Any] | None
    error: str | None


@dataclass
class JobContext:
    """What a kind sees: its options, dataset, the served model, and state kept between stages."""

    job_id: str
    model: str
    options: Any
    dataset: Readable
    state: dict[str, Any]
    context_cap: int
    max_items: int


class JobKind:
    """Base of job kinds."""

    name: ClassVar[str] = ""
    Options: ClassVar[type[JobOptions]] = JobOptions
    # The endpoint its stages send to: the job's model must serve it (checked at submission).
    endpoint: ClassVar[str] = "/v1/chat/completions"

    def parse_options(self, options: dict[str, Any]) -> JobOptions:
        from pydantic import ValidationError

        try:
            return self.Options.model_validate(options)
        except ValidationError as exc:
            first = exc.errors()[0]
            loc = ".".join(str(p) for p in first["loc"])
            raise InvalidRequest(f"options.{loc}: {first['msg']}", param=f"options.{loc}") from None

    def check_options(self, options: Any, *, served_models: set[str]) -> None:
        """Cross-checks against the fleet (e.g. a judge model that is served): ``served_models``
        are the models that serve the kind's :attr:`endpoint`."""

    def start(self, ctx: JobContext) -> Stage:
        raise NotImplementedError

    def advance(self, ctx: JobContext, answers: dict[str, Answer]) -> Stage | Finished:
        raise NotImplementedError


def read_dataset(
    source: Readable, *, required: tuple[str, ...], max_items: int
) -> Iterator[tuple[int, dict[str, Any]]]:
    """JSONL objects with the required string fields; any bad line is a 400 naming the lines."""
    problems: list[str] = []
    items: list[tuple[int, dict[str, Any]]] = []
    with source.open("rb") as f:
        for no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            if len(items) >= max_items:
                problems.append(f"more than {max_items} items")
                break
            try:
                obj = json.loads(raw)
            except (ValueError, RecursionError):  # RecursionError: nested too deep
                problems.append(f"line {no}: not valid JSON")
                continue
            if not isinstance(obj, dict):
                problems.append(f"line {no}: not a JSON object")
                continue
            missing = [k for k in required if not isinstance(obj.get(k), str)]
            if missing:
                problems.append(f"line {no}: needs string field(s) {', '.join(missing)}")
                continue
            items.append((no, obj))
    if not items and not problems:
        problems.append("the dataset has no items")
    if problems:
        shown = "; ".join(problems[:MAX_REPORTED])
        more = f" (and {len(problems) - MAX_REPORTED} more)" if len(problems) > MAX_REPORTED else ""
        raise InvalidRequest(f"bad dataset: {shown}{more}", param="input_file_id", code="invalid_dataset")
    yield from items
