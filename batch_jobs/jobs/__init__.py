"""Job kinds that compile into batch lines plus a post-processing step: ``eval`` (offline eval with
a scorer and a report), ``embedding_backfill`` (JSONL and ``.npy``), ``summaries`` (map-reduce)."""

from tidal.batch_jobs.jobs.base import Answer, Finished, JobContext, JobKind, JobOptions, OutputFile, Stage
from tidal.batch_jobs.jobs.service import KINDS, JobService

__all__ = [
    "KINDS",
    "Answer",
    "Finished",
    "JobContext",
    "JobKind",
    "JobOptions",
    "JobService",
    "OutputFile",
    "Stage",
]
