"""Job kinds as pure logic: scorers, the confidence interval, splitting, and each kind's stages
from a dataset to its outputs (answers are given; execution is tested end to end elsewhere)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tidal.batch_jobs.errors import InvalidRequest
from tidal.batch_jobs.jobs import KINDS, Answer, Finished, JobContext, Stage
from tidal.batch_jobs.jobs.scoring import judge_verdict, score_item, wilson_interval
from tidal.batch_jobs.jobs.summaries import split_text


@pytest.mark.parametrize(
    ("scorer", "output", "reference", "pattern", "score"),
    [
        ("exact", " Paris. ", "paris", None, 1),
        ("exact", "Paris, France", "paris", None, 0),
        ("contains", "It is Paris, France.", "PARIS", None, 1),
        ("contains", "Lyon", "Paris", None, 0),
        ("regex", "answer: 42", "42", r"answer:\s*\d+", 1),
        ("regex", "answer: none", "42", r"answer:\s*\d+", 0),
        ("regex", "the year 1999", r"\b19\d\d\b", None, 1),  # the reference is the pattern
        ("regex", "a" * 40 + "!", "", r"(a+)+$", 0),  # pathological pattern: bounded, no hang
    ],
)
def test_scorers(scorer: Any, output: str, reference: str, pattern: str | None, score: int) -> None:
    assert score_item(scorer, output, reference, pattern=pattern) == score


@pytest.mark.parametrize(
    ("reply", "verdict"), [("YES", 1), ("yes.", 1), ("**Yes**", 1), ("No", 0), ("maybe yes", 0), ("", 0)]
)
def test_judge_verdicts(reply: str, verdict: int) -> None:
    assert judge_verdict(reply) == verdict


@pytest.mark.parametrize(
    ("k", "n", "lo", "hi"),
    [
        (45, 50, 0.7864, 0.9565),
        (0, 10, 0.0, 0.2775),
        (10, 10, 0.7225, 1.0),
        (5, 10, 0.2366, 0.7634),
        (0, 0, 0.0, 1.0),
    ],
)
def test_wilson_interval(k: int, n: int, lo: float, hi: float) -> None:
    got = wilson_interval(k, n)
    assert got == pytest.approx((lo, hi), abs=1e-4)


def test_split_text_cuts_at_paragraphs_then_sentences_then_words() -> None:
    text = "First sentence here. Second one follows.\n\nA new paragraph starts. " + "word " * 50
    pieces = split_text(text, 60)
    assert all(len(p) <= 60 for p in pieces)
    assert pieces[0] == "First sentence here. Second one follows."
    assert " ".join(pieces).split() == text.split()  # nothing lost
    assert split_text("short", 60) == ["short"]


def _ctx(
    tmp_path: Path, kind: str, rows: list[dict[str, Any]], options: dict[str, Any], cap: int = 4096
) -> JobContext:
    ds = tmp_path / "ds.jsonl"
    ds.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return JobContext(
        job_id="job_1",
        model="tiny",
        options=KINDS[kind].parse_options(options),
        dataset=ds,
        state={},
        context_cap=cap,
        max_items=1000,
    )


def _chat(text: str) -> dict[str, Any]:
    return {"choices": [{"message": {"role": "assistant", "content": text}}]}


def _answers(stage: Stage, reply: Any) -> dict[str, Answer]:
    return {ln["custom_id"]: Answer(ln["custom_id"], True, reply(ln), None) for ln in stage.lines}


def test_offline_eval_scores_with_a_wilson_interval_and_per_item_results(tmp_path: Path) -> None:
    rows = [
        {"id": f"q{i}", "prompt": f"capital {i}?", "reference": "paris" if i % 2 == 0 else "rome"}
        for i in range(10)
    ]
    ctx = _ctx(tmp_path, "eval", rows, {"scorer": "contains", "max_tokens": 8, "system": "Be brief."})
    kind = KINDS["eval"]
    stage = kind.start(ctx)
    assert stage.endpoint == "/v1/chat/completions" and len(stage.lines) == 10
    assert stage.lines[0]["body"]["messages"][0] == {"role": "system", "content": "Be brief."}
    answers = _answers(stage, lambda ln: _chat("It is Paris"))
    answers["item-9"] = Answer("item-9", False, None, "replica unavailable")  # one item failed
    done = kind.advance(ctx, answers)
    assert isinstance(done, Finished)
    r = done.result
    assert (r["n"], r["scored"], r["correct"], r["failed"]) == (10, 9, 5, 1)
    assert r["score"] == pytest.approx(5 / 9)
    assert r["ci95"] == pytest.approx(list(wilson_interval(5, 9)))
    report = json.loads(done.outputs["report"].content)
    assert report["items"][0] == {
        "id": "q0",
        "prompt": "capital 0?",
        "reference": "paris",
        "output": "It is Paris",
        "correct": True,
    }
    assert report["items"][9]["correct"] is None


def test_a_judged_eval_runs_a_second_stage_on_the_judge_model(tmp_path: Path) -> None:
    rows = [{"prompt": "2+2?", "reference": "4"}, {"prompt": "3+3?", "reference": "6"}]
    ctx = _ctx(tmp_path, "eval", rows, {"scorer": "judge", "judge_model": "judge"})
    kind = KINDS["eval"]
    gen = kind.start(ctx)
    judge = kind.advance(ctx, _answers(gen, lambda ln: _chat("four")))
    assert isinstance(judge, Stage) and judge.name == "judge"
    assert {ln["body"]["model"] for ln in judge.lines} == {"judge"}
    assert "Reference answer:\n4" in judge.lines[0]["body"]["messages"][0]["content"]
    done = kind.advance(
        ctx, _answers(judge, lambda ln: _chat("YES" if ln["custom_id"] == "judge-0" else "NO"))
    )
    assert isinstance(done, Finished) and done.result["correct"] == 1 and done.result["scored"] == 2


def test_eval_options_are_checked() -> None:
    with pytest.raises(InvalidRequest, match="judge_model"):
        KINDS["eval"].parse_options({"scorer": "judge"})
    with pytest.raises(InvalidRequest, match="pattern"):
        KINDS["eval"].parse_options({"scorer": "regex", "pattern": "(unclosed"})
    with pytest.raises(InvalidRequest, match="options.bogus"):
        KINDS["eval"].parse_options({"bogus": 1})


def test_bad_datasets_name_their_lines(tmp_path: Path) -> None:
    ctx = _ctx(tmp_path, "eval", [], {})
    ctx.dataset.write_text('{"prompt": "x", "reference": "y"}\nnot json\n{"prompt": "x"}\n')
    with pytest.raises(InvalidRequest, match="line 2: not valid JSON; line 3: needs string field"):
        KINDS["eval"].start(ctx)


def test_embedding_backfill_writes_jsonl_and_npy_in_dataset_order(tmp_path: Path) -> None:
    rows = [{"id": f"d{i}", "text": f"text {i}"} for i in range(5)]
    ctx = _ctx(tmp_path, "embedding_backfill", rows, {"items_per_request": 2})
    kind = KINDS["embedding_backfill"]
    stage = kind.start(ctx)
    assert stage.endpoint == "/v1/embeddings"
    assert [ln["body"]["input"] for ln in stage.lines] == [
        ["text 0", "text 1"],
        ["text 2", "text 3"],
        ["text 4"],
    ]

    def embed(ln: dict[str, Any]) -> dict[str, Any]:
        base = int(ln["custom_id"].split("-")[1]) * 2
        # vLLM may return the data out of order; "index" says which input each vector is for
        data = [
            {"index": j, "embedding": [float(base + j), 1.0, 2.0]} for j in range(len(ln["body"]["input"]))
        ]
        return {"data": list(reversed(data))}

    answers = _answers(stage, embed)
    answers["group-1"] = Answer("group-1", False, None, "boom")
    done = kind.advance(ctx, answers)
    assert isinstance(done, Finished)
    assert done.result["embedded"] == 3 and done.result["failed_ids"] == ["d2", "d3"]
    rows_out = [json.loads(x) for x in done.outputs["embeddings"].content.decode().splitlines()]
    assert [r["id"] for r in rows_out] == ["d0", "d1", "d4"]
    matrix = np.load(io.BytesIO(done.outputs["vectors"].content))
    assert matrix.dtype == np.float32 and matrix.shape == (3, 3)
    assert matrix[:, 0].tolist() == [0.0, 1.0, 4.0]


def test_summaries_split_long_documents_and_reduce_until_one_summary(tmp_path: Path) -> None:
    long_doc = " ".join(f"Sentence number {i} says something." for i in range(200))  # ~7,000 chars
    rows = [{"id": "short", "text": "A short note."}, {"id": "long", "text": long_doc}]
    # A cap of 700 tokens: pieces of (700 - 64 - 100) * 3 = 1,608 characters
    ctx = _ctx(tmp_path, "summaries", rows, {"max_tokens": 100}, cap=700)
    kind = KINDS["summaries"]
    stage = kind.start(ctx)
    per_doc: dict[str, int] = {}
    for ln in stage.lines:
        d = ln["custom_id"].split("-")[1]
        per_doc[d] = per_doc.get(d, 0) + 1
        assert len(ln["body"]["messages"][0]["content"]) <= 1608 + 100
    assert per_doc["d0"] == 1 and per_doc["d1"] >= 5
    rounds = 0
    out: Stage | Finished = stage
    while isinstance(out, Stage):
        rounds += 1
        # Each summary is ~600 characters, so the reduce step needs more than one round
        out = kind.advance(ctx, _answers(out, lambda ln: _chat("s" * 599 + ".")))
    assert isinstance(out, Finished)
    docs = {
        json.loads(x)["id"]: json.loads(x) for x in out.outputs["summaries"].content.decode().splitlines()
    }
    assert docs["short"]["rounds"] == 1 and docs["long"]["rounds"] >= 3 and rounds == docs["long"]["rounds"]
    assert docs["long"]["pieces"] >= 5 and out.result["split_documents"] == 1 and out.result["failed"] == 0


def test_summaries_refuse_a_cap_that_leaves_no_room(tmp_path: Path) -> None:
    ctx = _ctx(tmp_path, "summaries", [{"text": "x"}], {"max_tokens": 1000}, cap=1200)
    with pytest.raises(InvalidRequest, match="no room"):
        KINDS["summaries"].start(ctx)
