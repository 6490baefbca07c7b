"""Embedded defaults: the fleet `tidal up` runs when no config is given."""

from __future__ import annotations

from pathlib import Path

__all__ = ["DEFAULT_FLEET_PATH"]

DEFAULT_FLEET_PATH = Path(__file__).with_name("fleet.yaml")
