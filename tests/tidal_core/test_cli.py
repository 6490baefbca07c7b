"""Every command describes itself."""

from __future__ import annotations

import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from tidal.cli import COMMANDS, LazyGroup, cli


def _all_commands() -> list[tuple[str, ...]]:
    paths: list[tuple[str, ...]] = [()]
    for name in COMMANDS:
        cmd = LazyGroup._load(name)
        if cmd is None:
            continue
        paths.append((name,))
        if isinstance(cmd, click.Group):
            paths += [(name, sub) for sub in cmd.commands]
    return paths


@pytest.mark.parametrize("path", _all_commands(), ids=lambda p: " ".join(p) or "tidal")
def test_help_describes_the_command(path: tuple[str, ...]) -> None:
    result = CliRunner().invoke(cli, [*path, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output
    body = result.output.split("\n\n", 1)[1].strip()
    assert len(body) > 20, f"`tidal {' '.join(path)} --help` does not describe itself:\n{result.output}"


def test_console_entry_point_runs() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tidal", "--version"], capture_output=True, text=True, check=True
    )
    assert "tidal" in out.stdout


def test_keys_new_prints_a_key_and_its_hash() -> None:
    result = CliRunner().invoke(cli, ["keys", "new"])
    key = result.output.split("key:")[1].split()[0]
    stored = result.output.split("hash:")[1].split()[0]
    from tidal.fleet import verify_api_key

    assert verify_api_key(key, stored)


def test_fleet_check_names_bad_keys(tmp_path) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "f.yaml"
    bad.write_text(
        "models: [{name: m}]\npools: {p: {kind: interactive, model: m, replicas: [{name: r, url: 'x'}]}}\n"
    )
    result = CliRunner().invoke(cli, ["fleet", "check", str(bad)])
    assert result.exit_code == 1
    assert "pools.p.replicas[0].url" in result.output


@pytest.mark.parametrize("name", ["autoscale", "batch", "sim", "kv-keys", "router-scale"])
def test_bench_refuses_an_option_the_benchmark_does_not_take(name: str) -> None:
    """A misspelt option is an error naming it and the known ones, not silently a default run
    (and ``--out-dir`` cannot collide with ``--out``)."""
    for bad in ("--bogus-option", "--out-dir"):
        result = CliRunner().invoke(cli, ["bench", name, bad, "1"])
        assert result.exit_code == 2, result.output
        assert f"unknown option(s) for benchmark '{name}': {bad}" in result.output
        assert "(known: --" in result.output or "(known: none)" in result.output


@pytest.mark.parametrize("verbose", [False, True])
def test_a_client_command_logs_its_http_requests_only_when_verbose(verbose: bool) -> None:
    """`tidal jobs status` against a server answering 404: the user sees the answer; the
    per-request `HTTP Request: ...` lines only with --verbose."""
    import http.server
    import threading

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b'{"error": {"message": "No such job", "type": "not_found_error", "param": null, "code": null}}'
            self.send_response(404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        argv = [sys.executable, "-m", "tidal", *(["--verbose"] if verbose else []), "jobs", "status", "job_x"]
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        out = subprocess.run(
            [*argv, "--base-url", url, "--api-key", "k"], capture_output=True, text=True, timeout=60
        )
    finally:
        server.shutdown()
    text = out.stdout + out.stderr
    assert "No such job" in text, text
    assert ("HTTP Request:" in text) is verbose, text
