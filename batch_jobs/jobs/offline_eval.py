"""Offline eval: a JSONL dataset of prompts and references, a scorer, and a report with the score,
its 95 % confidence interval and per-item results.

Dataset lines: ``{"prompt": "...", "reference": "...", "id": "optional"}`` (or ``"messages"`` in
place of ``prompt``). Options (besides priority/lane/pool/replica_group)::

    {"scorer": "exact" | "contains" | "regex" | "judge",
     "pattern": "optional regex for the regex scorer",
     "judge_model": "model that grades, for the judge scorer",
     "max_tokens": 64, "temperature": 0.0, "system": "optional system prompt"}

To compare builds (the canary controller does), run the same eval with ``pool`` or
``replica_group`` naming the replicas under test, and the job's ``model`` the model they serve.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, model_validator

from tidal.batch_jobs.errors import InvalidRequest
from tidal.batch_jobs.jobs.base import (
    Answer,
    Finished,
    JobContext,
    JobKind,
    JobOptions,
    OutputFile,
    Stage,
    read_dataset,
)
from tidal.batch_jobs.jobs.scoring import (
    JUDGE_PROMPT,
    compile_pattern,
    judge_verdict,
    score_item,
    wilson_interval,
)

__all__ = ["EvalOptions", "OfflineEval"]


class EvalOptions(JobOptions):
    scorer: Literal["exact", "contains", "regex", "judge"] = "exact"
    pattern: str | None = Field(default=None, max_length=256)
    judge_model: str | None = Field(default=None, max_length=256)
    max_tokens: int = Field(default=64, ge=1, le=8192)
    judge_max_tokens: int = Field(default=4, ge=1, le=64)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    system: str | None = Field(default=None, max_length=8192)

    @model_validator(mode="after")
    def _check(self) -> EvalOptions:
        if self.scorer == "judge" and not self.judge_model:
            raise ValueError("the judge scorer needs judge_model")
        if self.pattern is not None:
            compile_pattern(self.pattern)
        return self


def _text_of(body: dict[str, Any] | None) -> str:
    try:
        choice = (body or {})["choices"][0]
        msg = choice.get("message")
        return str(msg.get("content") or "") if isinstance(msg, dict) else str(choice.get("text") or "")
    except (KeyError, IndexError, TypeError, AttributeError):
        return ""


class OfflineEval(JobKind):
    """``eval``: generate, optionally judge, then score with a Wilson interval."""

    name = "eval"
    Options = EvalOptions

    def check_options(self, options: Any, *, served_models: set[str]) -> None:
        if options.judge_model is not None and options.judge_model not in served_models:
            raise InvalidRequest(
                f"options.judge_model {options.judge_model!r} is not served", param="options.judge_model"
            )

    def start(self, ctx: JobContext) -> Stage:
        o: EvalOptions = ctx.options
        items = []
        lines = []
        for i, (_, obj) in enumerate(
            read_dataset(ctx.dataset, required=("reference",), max_items=ctx.max_items)
        ):
            prompt = obj.get("prompt")
            messages = obj.get("messages")
            if not isinstance(messages, list):
                if not isinstance(prompt, str):
                    raise InvalidRequest(
                        f"dataset item {i + 1} needs 'prompt' or 'messages'", param="input_file_id"
                    )
                messages = [{"role": "user", "content": prompt}]
            if o.system:
                messages = [{"role": "system", "content": o.system}, *messages]
            items.append(
                {
                    "id": str(obj.get("id", i)),
                    "prompt": prompt if isinstance(prompt, str) else json.dumps(messages)[:2000],
                    "reference": obj["reference"],
                }
            )
            body = {
                "model": ctx.model,
                "messages": messages,
                "max_tokens": o.max_tokens,
                "temperature": o.temperature,
            }
            lines.append({"custom_id": f"item-{i}", "body": body})
        ctx.state["items"] = items
        return Stage("/v1/chat/completions", lines, name="generate")

    def advance(self, ctx: JobContext, answers: dict[str, Answer]) -> Stage | Finished:
        o: EvalOptions = ctx.options
        items: list[dict[str, Any]] = ctx.state["items"]
        if "outputs" not in ctx.state:
            outputs: list[str | None] = []
            for i in range(len(items)):
                a = answers.get(f"item-{i}")
                outputs.append(_text_of(a.body) if a is not None and a.ok else None)
            ctx.state["outputs"] = outputs
            if o.scorer == "judge":
                assert o.judge_model is not None
                lines = [
                    {
                        "custom_id": f"judge-{i}",
                        "body": {
                            "model": o.judge_model,
                            "messages": [
                                {
                                    "role": "user",
                                    "content": JUDGE_PROMPT.format(
                                        prompt=it["prompt"], reference=it["reference"], output=out
                                    ),
                                }
                            ],
                            "max_tokens": o.judge_max_tokens,
                            "temperature": 0.0,
                        },
                    }
                    for i, (it, out) in enumerate(zip(items, outputs, strict=True))
                    if out is not None
                ]
                if lines:
                    return Stage("/v1/chat/completions", lines, name="judge")
        return self._report(ctx, answers)

    def _report(self, ctx: JobContext, answers: dict[str, Answer]) -> Finished:
        o: EvalOptions = ctx.options
        items: list[dict[str, Any]] = ctx.state["items"]
        outputs: list[str | None] = ctx.state["outputs"]
        per_item = []
        correct = scored = failed = 0
        for i, (it, out) in enumerate(zip(items, outputs, strict=True)):
            verdict: int | None = None
            if out is not None:
                if o.scorer == "judge":
                    j = answers.get(f"judge-{i}")
                    verdict = judge_verdict(_text_of(j.body)) if j is not None and j.ok else None
                else:
                    verdict = score_item(o.scorer, out, it["reference"], pattern=o.pattern)
            if verdict is None:
                failed += 1
            else:
                scored += 1
                correct += verdict
            per_item.append({**it, "output": out, "correct": None if verdict is None else bool(verdict)})
        lo, hi = wilson_interval(correct, scored)
        summary = {
            "kind": "eval",
            "model": ctx.model,
            "scorer": o.scorer,
            "n": len(items),
            "scored": scored,
            "correct": correct,
            "failed": failed,
            "score": correct / scored if scored else None,
            "ci95": [lo, hi],
            "ci_method": "wilson",
            "pool": o.pool,
            "replica_group": o.replica_group,
        }
        report = {**summary, "items": per_item}
        results = "".join(json.dumps(r) + "\n" for r in per_item)
        return Finished(
            summary,
            {
                "report": OutputFile(f"{ctx.job_id}_report.json", json.dumps(report, indent=1).encode()),
                "results": OutputFile(f"{ctx.job_id}_results.jsonl", results.encode()),
            },
        )
