"""Summaries: one summary per document; a document longer than the context cap is split, its
pieces summarised (map), and the piece summaries summarised together (reduce), again and again
until one remains.

Dataset lines: ``{"id": "doc-1", "text": "..."}``. The cap is the ``batch`` feature's context
cap (capped by the model's ``max_model_len``), or the smaller ``context_cap`` option. Token counts
are estimated from characters (``chars_per_token``, 3 by default: conservative for English), so
a piece plus the instruction plus ``max_tokens`` stays inside the cap.
Output: ``summaries`` (JSONL ``{"id", "summary", "pieces", "rounds"}``).
"""

from __future__ import annotations

import json
import re
from typing import Any

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

__all__ = ["SummariesKind", "SummaryOptions", "split_text"]

MAX_ROUNDS = 8
PROMPT_OVERHEAD_TOKENS = 64
MAP_PROMPT = "Summarise the following text in a few sentences.\n\n{text}"
REDUCE_PROMPT = "These are summaries of consecutive parts of one document. Write one summary of the whole document.\n\n{text}"


class SummaryOptions(JobOptions):
    max_tokens: int = Field(default=128, ge=1, le=8192)
    context_cap: int | None = Field(default=None, ge=64, le=10_000_000)
    chars_per_token: float = Field(default=3.0, ge=0.5, le=16.0)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)

    @model_validator(mode="after")
    def _check(self) -> SummaryOptions:
        if self.context_cap is not None and self.context_cap < 4 * self.max_tokens + PROMPT_OVERHEAD_TOKENS:
            raise ValueError("context_cap must leave room for at least 3 summaries of max_tokens")
        return self


_PARAGRAPH = re.compile(r"\n\s*\n")
_SENTENCE = re.compile(r"(?<=[.!?])\s+")


def split_text(text: str, max_chars: int) -> list[str]:
    """Pieces of at most ``max_chars``, cut at paragraph, then sentence, then word boundaries."""
    if len(text) <= max_chars:
        return [text]
    pieces: list[str] = []
    current = ""
    units = [u for p in _PARAGRAPH.split(text) for u in _SENTENCE.split(p) if u.strip()]
    for unit in units:
        while len(unit) > max_chars:  # a sentence longer than a piece: cut at a space if one exists
            cut = unit.rfind(" ", 0, max_chars)
            cut = cut if cut > max_chars // 2 else max_chars
            if current:
                pieces.append(current)
                current = ""
            pieces.append(unit[:cut].strip())
            unit = unit[cut:].strip()
        candidate = f"{current} {unit}".strip() if current else unit
        if len(candidate) > max_chars:
            pieces.append(current)
            current = unit
        else:
            current = candidate
    if current:
        pieces.append(current)
    return pieces


class SummariesKind(JobKind):
    """``summaries``: map-reduce rounds until each document has one summary."""

    name = "summaries"
    Options = SummaryOptions

    def _budget_chars(self, ctx: JobContext) -> int:
        o: SummaryOptions = ctx.options
        cap = min(o.context_cap or ctx.context_cap, ctx.context_cap)
        tokens = cap - o.max_tokens - PROMPT_OVERHEAD_TOKENS
        if tokens < 2 * o.max_tokens:
            raise InvalidRequest(
                f"the context cap ({cap}) leaves no room to summarise with max_tokens={o.max_tokens}",
                param="options.max_tokens",
            )
        return int(tokens * o.chars_per_token)

    def start(self, ctx: JobContext) -> Stage:
        budget = self._budget_chars(ctx)
        docs = []
        for i, (_, obj) in enumerate(read_dataset(ctx.dataset, required=("text",), max_items=ctx.max_items)):
            parts = split_text(obj["text"], budget)
            docs.append({"id": str(obj.get("id", i)), "parts": parts, "pieces": len(parts), "rounds": 0})
        ctx.state["docs"] = docs
        ctx.state["round"] = 0
        return self._stage(ctx)

    def _stage(self, ctx: JobContext) -> Stage:
        o: SummaryOptions = ctx.options
        r = ctx.state["round"]
        lines = []
        for d, doc in enumerate(ctx.state["docs"]):
            if doc.get("summary") is not None or doc.get("error"):
                continue
            prompt = MAP_PROMPT if doc["rounds"] == 0 else REDUCE_PROMPT
            for p, part in enumerate(doc["parts"]):
                body = {
                    "model": ctx.model,
                    "messages": [{"role": "user", "content": prompt.format(text=part)}],
                    "max_tokens": o.max_tokens,
                    "temperature": o.temperature,
                }
                lines.append({"custom_id": f"r{r}-d{d}-p{p}", "body": body})
        return Stage("/v1/chat/completions", lines, name=f"round-{r}")

    def advance(self, ctx: JobContext, answers: dict[str, Answer]) -> Stage | Finished:
        budget = self._budget_chars(ctx)
        r = ctx.state["round"]
        for d, doc in enumerate(ctx.state["docs"]):
            if doc.get("summary") is not None or doc.get("error"):
                continue
            outs: list[str] = []
            for p in range(len(doc["parts"])):
                a = answers.get(f"r{r}-d{d}-p{p}")
                text = _content(a.body) if a is not None and a.ok else None
                if text is None:
                    doc["error"] = (a.error if a is not None else None) or "a piece could not be summarised"
                    break
                outs.append(text)
            if doc.get("error"):
                continue
            doc["rounds"] += 1
            if len(outs) == 1:
                doc["summary"] = outs[0]
                doc["parts"] = []
                continue
            if doc["rounds"] >= MAX_ROUNDS:
                doc["error"] = f"no single summary after {MAX_ROUNDS} rounds"
                continue
            combined = "\n\n".join(outs)
            doc["parts"] = split_text(combined, budget)
        ctx.state["round"] = r + 1
        if any(doc.get("summary") is None and not doc.get("error") for doc in ctx.state["docs"]):
            return self._stage(ctx)
        docs = ctx.state["docs"]
        rows = [
            {"id": doc["id"], "summary": doc.get("summary"), "pieces": doc["pieces"], "rounds": doc["rounds"]}
            | ({"error": doc["error"]} if doc.get("error") else {})
            for doc in docs
        ]
        result: dict[str, Any] = {
            "kind": "summaries",
            "model": ctx.model,
            "documents": len(docs),
            "summarised": sum(1 for doc in docs if doc.get("summary") is not None),
            "failed": sum(1 for doc in docs if doc.get("error")),
            "split_documents": sum(1 for doc in docs if doc["pieces"] > 1),
            "max_rounds": max((doc["rounds"] for doc in docs), default=0),
        }
        jsonl = "".join(json.dumps(row) + "\n" for row in rows)
        return Finished(result, {"summaries": OutputFile(f"{ctx.job_id}_summaries.jsonl", jsonl.encode())})


def _content(body: dict[str, Any] | None) -> str | None:
    try:
        content = (body or {})["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        return None
    return content if isinstance(content, str) else None
