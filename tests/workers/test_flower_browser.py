"""Flower, opened in Debian's headless Chromium, shows the lanes' workers behind basic auth.

The screenshot it takes goes to the test's temporary directory; with ``TIDAL_UPDATE_SCREENSHOTS=1``
it replaces the committed ``docs/flower-workers.png`` (so a plain test run leaves the tree clean).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.batch_tier import ROOT, BatchTier, require_rabbitmq, running_tier, tiny_fleet, wait_for
from tests.services import headless_chromium
from tidal.replicas.launcher import free_port

pytestmark = [pytest.mark.browser, pytest.mark.rabbitmq]

COMMITTED_SCREENSHOT = ROOT / "docs" / "flower-workers.png"
AUTH = "ops:flower-test-password"


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[BatchTier]:
    require_rabbitmq()
    # Workers never reach a replica here: the page is about who consumes which lane.
    with running_tier(
        tmp_path,
        f"sqlite:///{tmp_path / 'tidal.db'}",
        tiny_fleet(["http://127.0.0.1:9"]),
        extra_env={"TIDAL_FLOWER_BASIC_AUTH": AUTH},
    ) as t:
        yield t


def _status(url: str, auth: tuple[str, str] | None = None) -> int:
    req = urllib.request.Request(url)
    if auth:
        import base64

        req.add_header("Authorization", "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def test_flower_shows_the_lanes_workers_behind_basic_auth(tier: BatchTier, tmp_path: Path) -> None:
    workers = tier.start_workers(["reserved", "spot", "shared"], concurrency=1)
    port = free_port()
    log = (tmp_path / "flower.log").open("wb")
    flower = subprocess.Popen(
        [sys.executable, "-m", "tidal", "flower", "--port", str(port)],
        cwd=ROOT,
        env={**os.environ, **tier.env()},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: _status(base + "/healthcheck") == 200, 60, "Flower to start")
        # Without the password: 401
        assert _status(base + "/workers") == 401
        user, password = AUTH.split(":")
        wait_for(
            lambda: all(w.hostname_prefix in _api_workers(base, (user, password)) for w in workers),
            30,
            "Flower to see every worker",
        )
        # When a person opens the workers page in a browser
        profile = tmp_path / "chromium-profile"
        url = f"http://{user}:{password}@127.0.0.1:{port}/workers"
        browser = [*headless_chromium(profile, window="1280,720"), "--virtual-time-budget=5000"]
        dom = subprocess.run([*browser, "--dump-dom", url], capture_output=True, text=True, timeout=90).stdout
        # Then the page lists a worker of each lane, online
        for lane in ("reserved", "spot", "shared"):
            assert f"{lane}@" in dom, dom[:2000]
        assert "Online" in dom
        screenshot = tmp_path / "flower-workers.png"
        subprocess.run(
            [*browser, f"--screenshot={screenshot}", url], capture_output=True, timeout=90, check=True
        )
        assert screenshot.stat().st_size > 10_000
        if os.environ.get("TIDAL_UPDATE_SCREENSHOTS") == "1":
            shutil.copyfile(screenshot, COMMITTED_SCREENSHOT)
    finally:
        flower.terminate()
        try:
            flower.wait(15)
        except subprocess.TimeoutExpired:
            flower.kill()
        log.close()


def _api_workers(base: str, auth: tuple[str, str]) -> str:
    import base64

    req = urllib.request.Request(base + "/api/workers?refresh=1")
    req.add_header("Authorization", "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return str(resp.read().decode())
    except OSError:
        return ""
