"""Process settings, read from ``TIDAL_*`` environment variables (and ``.env``).

The fleet (pools, replicas, features) lives in the fleet config file; these settings say where
things are and how this process runs. Outside development, unsafe defaults are refused.

Example::

    TIDAL_ENVIRONMENT=production TIDAL_ADMIN_KEY=... TIDAL_DATABASE_URL=postgresql+psycopg://... tidal gateway
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["DEFAULT_BROKER_URL", "Settings", "get_settings"]

DEFAULT_BROKER_URL = "amqp://guest:guest@127.0.0.1:5672//"
_DEV_FLOWER_AUTH = "tidal:tidal"


class Settings(BaseSettings):
    """Everything a Tidal process needs to know about its surroundings."""

    model_config = SettingsConfigDict(
        env_prefix="TIDAL_", env_file=".env", env_ignore_empty=True, extra="ignore"
    )

    environment: Literal["development", "test", "production"] = "development"
    data_dir: Path = Path(".tidal")
    fleet_config: Path | None = None

    # Store and files
    database_url: str | None = None
    files_dir: Path | None = None
    # Where file bytes live when gateways and workers do not share a disk: a PostgreSQL URL
    # (large objects; see batch_jobs.files_postgres). Unset: the local files_dir.
    files_url: str | None = Field(default=None, pattern=r"^postgres(ql)?(\+[a-z0-9_]+)?://")
    max_file_bytes: int = Field(default=200 * 1024 * 1024, gt=0)
    max_batch_lines: int = Field(default=50_000, gt=0)

    # Batch tier
    broker_url: str = DEFAULT_BROKER_URL
    chunk_lines: int = Field(default=50, gt=0, le=10_000)
    # How many of one tenant's chunks a lane holds in the broker (published, not yet finished)
    # when the fleet config gives the tenant no ``batch.max_lines_in_flight``: the rest wait in
    # the store and are published as these finish, in turn with other tenants' (round robin), so
    # a small batch waits behind at most this many chunks of a huge one. Keep it above the
    # lane's worker slots (workers x concurrency), or one tenant alone cannot fill the lane.
    batch_tenant_window_chunks: int = Field(default=32, ge=1, le=100_000)
    soft_shutdown_s: float = Field(default=20.0, ge=0)
    delivery_limit: int = Field(default=10, ge=1, le=1000)
    # Prefix of every queue and exchange of the batch tier, so that several deployments (and
    # test runs) can share one broker: <ns>.reserved, <ns>.spot, <ns>.shared, <ns>.dead, ...
    queue_namespace: str = Field(default="tidal", pattern=r"^[a-z][a-z0-9_-]{0,39}$")
    # A chunk stops sending new lines after this long and requeues the rest: it stays far below
    # RabbitMQ's consumer_timeout (30 min), which would otherwise close the channel.
    chunk_time_limit_s: float = Field(default=300.0, gt=0, le=1500)
    # Where the embedded broker (used when RabbitMQ is unreachable) keeps its messages.
    broker_dir: Path | None = None

    # Interactive tier: load state shared by every gateway process (router.shared). Unset: each
    # gateway routes on its own counts (the embedded default; `tidal gateway --workers N` refuses).
    redis_url: str | None = Field(default=None, pattern=r"^(redis|rediss|unix)://")
    # Prefix of every Redis key, so that several deployments (and test runs) can share one Redis.
    redis_namespace: str = Field(default="tidal", pattern=r"^[A-Za-z][A-Za-z0-9_.-]{0,39}$")

    # Security
    admin_key: str | None = None
    flower_basic_auth: str = _DEV_FLOWER_AUTH

    log_level: str = "INFO"

    @model_validator(mode="after")
    def _refuse_unsafe_defaults(self) -> Settings:
        if self.environment == "production":
            if not self.admin_key or len(self.admin_key) < 16:
                raise ValueError("TIDAL_ADMIN_KEY must be set (16+ characters) outside development")
            if self.flower_basic_auth == _DEV_FLOWER_AUTH:
                raise ValueError("TIDAL_FLOWER_BASIC_AUTH must be changed from the development default")
            if self.database_url is None:
                raise ValueError("TIDAL_DATABASE_URL must be set outside development")
        return self

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.data_dir / 'tidal.db').resolve()}"

    @property
    def resolved_files_dir(self) -> Path:
        return self.files_dir or self.data_dir / "files"

    @property
    def resolved_broker_dir(self) -> Path:
        return self.broker_dir or self.data_dir / "broker"


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
