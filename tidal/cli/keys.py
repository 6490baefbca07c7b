"""``tidal keys``: make API keys and the hashes the fleet config stores."""

from __future__ import annotations

import secrets

import click

__all__ = ["keys"]


@click.group()
def keys() -> None:
    """API key tools. The fleet config stores only `sha256:` hashes of keys."""


@keys.command("new")
@click.option("--prefix", default="tidal", show_default=True, help="Readable prefix of the key.")
def new(prefix: str) -> None:
    """Generate a random API key and print it with the hash to put in the fleet config.

    Example: tidal keys new --prefix team-search
    """
    from tidal.fleet import hash_api_key

    key = f"{prefix}-{secrets.token_urlsafe(32)}"
    click.echo(f"key:  {key}")
    click.echo(f"hash: {hash_api_key(key)}")


@keys.command("hash")
@click.argument("key")
def hash_(key: str) -> None:
    """Print the stored form (`sha256:<hex>`) of an existing key.

    Example: tidal keys hash "$MY_KEY"
    """
    from tidal.fleet import hash_api_key

    click.echo(hash_api_key(key))
