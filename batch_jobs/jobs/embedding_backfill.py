"""Embedding backfill: items to vectors, written as JSONL and as a NumPy ``.npy`` matrix.

Dataset lines: ``{"id": "doc-1", "text": "..."}``. Items are sent ``items_per_request`` at a time
(one ``/v1/embeddings`` request embeds a list). Outputs: ``embeddings`` (JSONL
``{"id", "embedding"}`` in dataset order) and ``vectors`` (float32 ``.npy``, one row per item of
the JSONL, same order); items that failed are listed in the job's result, in neither file.
"""

from __future__ import annotations

import io
import json
from typing import Any

import numpy as np
from pydantic import Field

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
from tidal.fleet import EMBEDDINGS_ENDPOINT

__all__ = ["EmbeddingBackfill", "EmbeddingOptions"]


class EmbeddingOptions(JobOptions):
    items_per_request: int = Field(default=16, ge=1, le=2048)
    dimensions: int | None = Field(default=None, ge=1, le=65536)


class EmbeddingBackfill(JobKind):
    """``embedding_backfill``: one stage of embedding requests, then the two output files."""

    name = "embedding_backfill"
    endpoint = EMBEDDINGS_ENDPOINT
    Options = EmbeddingOptions

    def start(self, ctx: JobContext) -> Stage:
        o: EmbeddingOptions = ctx.options
        items = [
            (str(obj.get("id", i)), obj["text"])
            for i, (_, obj) in enumerate(
                read_dataset(ctx.dataset, required=("text",), max_items=ctx.max_items)
            )
        ]
        ctx.state["ids"] = [i for i, _ in items]
        lines = []
        step = o.items_per_request
        for g, start in enumerate(range(0, len(items), step)):
            body: dict[str, Any] = {"model": ctx.model, "input": [t for _, t in items[start : start + step]]}
            if o.dimensions:
                body["dimensions"] = o.dimensions
            lines.append({"custom_id": f"group-{g}", "body": body})
        return Stage(self.endpoint, lines, name="embed")

    def advance(self, ctx: JobContext, answers: dict[str, Answer]) -> Finished:
        o: EmbeddingOptions = ctx.options
        ids: list[str] = ctx.state["ids"]
        step = o.items_per_request
        kept_ids: list[str] = []
        vectors: list[list[float]] = []
        failed: list[str] = []
        for g, start in enumerate(range(0, len(ids), step)):
            group = ids[start : start + step]
            a = answers.get(f"group-{g}")
            data = (a.body or {}).get("data") if a is not None and a.ok else None
            if not isinstance(data, list) or len(data) != len(group):
                failed += group
                continue
            for item_id, entry in zip(group, sorted(data, key=lambda d: d.get("index", 0)), strict=True):
                vec = entry.get("embedding") if isinstance(entry, dict) else None
                if not isinstance(vec, list):
                    failed.append(item_id)
                    continue
                kept_ids.append(item_id)
                vectors.append([float(x) for x in vec])
        dim = len(vectors[0]) if vectors else 0
        if any(len(v) != dim for v in vectors):
            raise ValueError("the model returned vectors of different sizes")
        matrix = np.asarray(vectors, dtype=np.float32).reshape(len(vectors), dim)
        buf = io.BytesIO()
        np.save(buf, matrix, allow_pickle=False)
        jsonl = "".join(
            json.dumps({"id": i, "embedding": v}) + "\n" for i, v in zip(kept_ids, vectors, strict=True)
        )
        result = {
            "kind": "embedding_backfill",
            "model": ctx.model,
            "items": len(ids),
            "embedded": len(kept_ids),
            "failed": len(failed),
            "failed_ids": failed[:1000],
            "dimensions": dim,
        }
        return Finished(
            result,
            {
                "embeddings": OutputFile(f"{ctx.job_id}_embeddings.jsonl", jsonl.encode()),
                "vectors": OutputFile(f"{ctx.job_id}_vectors.npy", buf.getvalue()),
            },
        )
