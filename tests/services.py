"""Reaching the real services tests need; absent services skip locally and fail under CI=true."""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
from pathlib import Path

import pytest

__all__ = ["headless_chromium", "in_ci", "require_module", "require_tcp", "require_tool"]


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _missing(reason: str) -> None:
    if in_ci():
        pytest.fail(f"{reason} (CI=true: a missing service is a failure, not a skip)", pytrace=False)
    pytest.skip(reason)


def require_tcp(name: str, host: str, port: int, timeout: float = 2.0) -> None:
    """Skip (or fail under CI) unless something accepts TCP connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return
    except OSError as exc:
        _missing(f"{name} is not reachable on {host}:{port}: {exc}")


def require_module(name: str, why: str) -> None:
    if importlib.util.find_spec(name) is None:
        _missing(f"python module {name!r} is not installed ({why})")


def require_tool(name: str, why: str) -> str:
    """The path of command ``name``; skip (or fail under CI) when it is not installed."""
    path = shutil.which(name)
    if path is None:
        _missing(f"{name} is not installed ({why}; scripts/setup --dev installs it)")
    assert path is not None
    return path


def headless_chromium(profile_dir: Path, window: str = "1200,3600") -> list[str]:
    """The command line of Debian's chromium, headless, with a throw-away profile; the page's URL
    and ``--dump-dom`` or ``--screenshot=FILE`` go after it."""
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        _missing("Debian's chromium is needed for browser tests (scripts/setup --dev installs it)")
    assert binary is not None
    return [
        binary,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile_dir}",
        f"--window-size={window}",
        "--hide-scrollbars",
    ]
