"""Audit the locked dependencies (requirements.lock) against PyPI's published advisories.

    scripts/audit [--lock requirements.lock] [--exceptions requirements-audit.toml] [--json OUT]

PyPI publishes, with each project's JSON (``/pypi/NAME/json``), the advisories (OSV: PYSEC, GHSA,
CVE ids) that affect the project's latest release. pip-audit asks for a given version instead
(``/pypi/NAME/VERSION/json``) or asks OSV; neither is reachable from every machine that runs CI,
the project JSON is. So a pin that is the latest release is checked against its advisories; a pin
behind the latest cannot be checked here and is listed with the release it is behind: as held back
where requirements-audit.toml says why (``[[held]]``: a package and what holds it), else as stale,
for ``scripts/lock`` to move forward.

An advisory on a locked version fails the audit unless requirements-audit.toml accepts it
(``[[accept]]``: its id and a reason). Exit status: 0 clean, 1 an advisory not accepted, 2 the
audit could not run (an unreadable lock, or PyPI unreachable or answering nonsense: never a pass).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import tomllib
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

INDEX = "https://pypi.org/pypi"
# torch's project JSON, the largest we fetch, is a few MiB; anything near this cap is not PyPI.
MAX_BODY = 64 * 1024 * 1024
TIMEOUT_S = 30.0
ATTEMPTS = 3
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)$")


class AuditError(Exception):
    """The audit could not run to a verdict."""


@dataclass(frozen=True)
class Advisory:
    id: str
    aliases: tuple[str, ...]
    fixed_in: tuple[str, ...]
    summary: str

    def names(self) -> set[str]:
        return {self.id, *self.aliases}


@dataclass
class Verdict:
    name: str
    pinned: str
    latest: str
    checked: bool
    advisories: list[Advisory] = field(default_factory=list)


def read_lock(path: Path) -> list[tuple[str, str]]:
    """``name==version`` lines; comments and blank lines aside, anything else is an error (an URL or
    a range is not a lock)."""
    pins: list[tuple[str, str]] = []
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = PIN.match(line)
        if match is None:
            raise AuditError(f"{path}:{number}: not a name==version pin: {raw.strip()!r}")
        pins.append((str(canonicalize_name(match[1])), match[2]))
    if not pins:
        raise AuditError(f"{path}: no pins")
    return pins


@dataclass
class Exceptions:
    """requirements-audit.toml: accepted advisories by id, held-back packages by name; each with
    its reason."""

    accepted: dict[str, str] = field(default_factory=dict)
    held: dict[str, str] = field(default_factory=dict)


def read_exceptions(path: Path | None) -> Exceptions:
    exceptions = Exceptions()
    if path is None or not path.exists():
        return exceptions
    try:
        document = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise AuditError(f"{path}: {exc}") from exc
    for table, key, into in (("accept", "id", exceptions.accepted), ("held", "package", exceptions.held)):
        for entry in document.get(table, []):
            name, reason = entry.get(key), entry.get("reason")
            if not isinstance(name, str) or not isinstance(reason, str) or not reason.strip():
                raise AuditError(f"{path}: every [[{table}]] needs `{key}` and `reason`: {entry!r}")
            into[str(canonicalize_name(name)) if table == "held" else name] = reason
    return exceptions


def fetch_project(index: str, name: str) -> dict[str, Any]:
    url = f"{index.rstrip('/')}/{name}/json"
    last: Exception | None = None
    for attempt in range(ATTEMPTS):
        try:
            with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
                body = response.read(MAX_BODY + 1)
            if len(body) > MAX_BODY:
                raise AuditError(f"{url}: answer larger than {MAX_BODY} bytes")
            document = json.loads(body)
            if not isinstance(document, dict):
                raise AuditError(f"{url}: not a JSON object")
            return document
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                raise AuditError(f"{url}: 404, {name} is not on the index") from exc
            last = exc
        except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
            last = exc
        except ValueError as exc:
            raise AuditError(f"{url}: not JSON: {exc}") from exc
        time.sleep(0.5 * 2**attempt)
    raise AuditError(f"{url}: unreachable after {ATTEMPTS} attempts: {last}")


def judge(name: str, pinned: str, document: dict[str, Any]) -> Verdict:
    info = document.get("info")
    latest = info.get("version") if isinstance(info, dict) else None
    if not isinstance(latest, str):
        raise AuditError(f"{name}: the project JSON names no latest version")
    try:
        # A local build (torch 2.13.0+cpu) is the public release it was built from.
        checked = Version(pinned).public == Version(latest).public
    except InvalidVersion as exc:
        raise AuditError(f"{name}: {exc}") from exc
    verdict = Verdict(name, pinned, latest, checked)
    if not checked:
        return verdict
    entries = document.get("vulnerabilities")
    if not isinstance(entries, list):
        raise AuditError(f"{name}: the project JSON has no vulnerabilities list")
    for entry in entries:
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
            raise AuditError(f"{name}: an advisory without an id: {entry!r}")
        if entry.get("withdrawn"):
            continue
        verdict.advisories.append(
            Advisory(
                id=entry["id"],
                aliases=tuple(str(a) for a in entry.get("aliases") or ()),
                fixed_in=tuple(str(v) for v in entry.get("fixed_in") or ()),
                summary=str(entry.get("summary") or entry.get("details") or "")[:160],
            )
        )
    return verdict


def audit(pins: list[tuple[str, str]], index: str, workers: int = 8) -> list[Verdict]:
    with ThreadPoolExecutor(workers) as pool:
        documents = list(pool.map(lambda pin: fetch_project(index, pin[0]), pins))
    return [judge(name, pinned, doc) for (name, pinned), doc in zip(pins, documents, strict=True)]


def report(verdicts: list[Verdict], exceptions: Exceptions) -> tuple[int, dict[str, Any]]:
    accepted = exceptions.accepted
    open_findings: list[dict[str, Any]] = []
    accepted_findings: list[dict[str, Any]] = []
    for verdict in verdicts:
        for advisory in verdict.advisories:
            finding = {
                "package": verdict.name,
                "version": verdict.pinned,
                "id": advisory.id,
                "aliases": list(advisory.aliases),
                "fixed_in": list(advisory.fixed_in),
                "summary": advisory.summary,
            }
            reason = next((accepted[n] for n in sorted(advisory.names()) if n in accepted), None)
            if reason is None:
                open_findings.append(finding)
            else:
                accepted_findings.append({**finding, "reason": reason})
    behind = [
        {"package": v.name, "pinned": v.pinned, "latest": v.latest, "held": exceptions.held.get(v.name)}
        for v in verdicts
        if not v.checked
    ]
    summary = {
        "locked": len(verdicts),
        "checked": sum(v.checked for v in verdicts),
        "behind": behind,
        "findings": open_findings,
        "accepted": accepted_findings,
        "held_unused": sorted(set(exceptions.held) - {item["package"] for item in behind}),
    }
    return (1 if open_findings else 0), summary


def main(argv: list[str] | None = None) -> int:
    root = Path(__file__).resolve().parent.parent
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lock", type=Path, default=root / "requirements.lock")
    parser.add_argument("--exceptions", type=Path, default=root / "requirements-audit.toml")
    parser.add_argument("--index", default=INDEX, help="the JSON API's base (default: %(default)s)")
    parser.add_argument("--json", type=Path, help="also write the summary here")
    args = parser.parse_args(argv)
    try:
        pins = read_lock(args.lock)
        exceptions = read_exceptions(args.exceptions)
        status, summary = report(audit(pins, args.index), exceptions)
    except AuditError as exc:
        print(f"scripts/audit: cannot audit: {exc}", file=sys.stderr)
        return 2
    for finding in summary["findings"]:
        fixed = ", ".join(finding["fixed_in"]) or "no fixed release"
        print(
            f"FINDING {finding['package']}=={finding['version']}: {finding['id']} (fixed in {fixed}) {finding['summary']}"
        )
    for finding in summary["accepted"]:
        print(f"accepted {finding['package']}=={finding['version']}: {finding['id']}: {finding['reason']}")
    held = [item for item in summary["behind"] if item["held"]]
    stale = [item for item in summary["behind"] if not item["held"]]
    for item in held:
        print(f"held    {item['package']}=={item['pinned']} (latest {item['latest']}): {item['held']}")
    for item in stale:
        print(f"stale   {item['package']}=={item['pinned']} (latest {item['latest']}): scripts/lock moves it")
    for name in summary["held_unused"]:
        print(f"note    {name} is held in requirements-audit.toml but its pin is the latest release")
    print(
        f"scripts/audit: {summary['locked']} locked packages: {summary['checked']} checked against PyPI's "
        f"advisories, {len(held)} held back and {len(stale)} stale (behind the latest release, not "
        f"checkable here); {len(summary['findings'])} findings, {len(summary['accepted'])} accepted"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
