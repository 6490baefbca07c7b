"""SQL that names the store's tables lives in the data layer only, so that a schema migration is a
change in one place: ``batch_jobs/queries.py`` (and ``store.py``) beside the tables
(``models.py``) and their migrations. Everyone else calls those functions.

``batch_jobs/files_postgres.py`` is the PostgreSQL file store: its own table, created and used
only there on its own connections, in the same transactions as its large-object calls.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from sqlmodel import SQLModel

import tidal.batch_jobs.models  # noqa: F401  (registers the tables)
from tests.test_layering import PACKAGES

ROOT = Path(__file__).resolve().parents[2]

DATA_LAYER = {
    "batch_jobs/queries.py",
    "batch_jobs/store.py",
    "batch_jobs/models.py",
    "batch_jobs/files_postgres.py",
}
DATA_LAYER_DIRS = ("batch_jobs/migrations/",)

TABLES = sorted({*SQLModel.metadata.tables, "tidal_file_blobs"})
_TABLE = re.compile(r"\b(" + "|".join(re.escape(t) for t in TABLES) + r")\b")
_SQL = re.compile(r"\b(SELECT|INSERT|UPDATE|DELETE|FROM|JOIN|WHERE|INTO|TABLE)\b", re.IGNORECASE)


def _offences(source: str, filename: str) -> list[str]:
    """Where ``source`` builds SQL itself: imports SQLAlchemy's ``text``, or holds a string (not
    a docstring) with an SQL keyword and one of the store's table names."""
    found: list[str] = []
    tree = ast.parse(source, filename=filename)
    prose = {
        id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in (
            "sqlalchemy",
            "sqlmodel",
        ):
            if any(a.name == "text" for a in node.names):
                found.append(f"{filename}:{node.lineno}: imports text() from {node.module}")
        elif (
            isinstance(node, ast.Attribute)
            and node.attr == "text"
            and isinstance(node.value, ast.Name)
            and node.value.id in ("sqlalchemy", "sa", "sqlmodel")
        ):
            found.append(f"{filename}:{node.lineno}: {node.value.id}.text")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            table = _TABLE.search(node.value)
            if table and _SQL.search(node.value):
                found.append(f"{filename}:{node.lineno}: SQL on {table.group(1)}")
    return found


def _allowed(rel: str) -> bool:
    return rel in DATA_LAYER or rel.startswith(DATA_LAYER_DIRS)


def test_the_tables_are_known() -> None:
    assert {"tidal_batches", "tidal_batch_lines", "tidal_batch_chunks", "tidal_jobs"} <= set(TABLES)


def test_the_check_finds_sql() -> None:
    assert _offences("from sqlalchemy import bindparam, text\n", "a.py")
    assert _offences("import sqlalchemy\nsqlalchemy.text('SELECT 1')\n", "a.py")
    assert _offences("q = 'SELECT id FROM tidal_batches'\n", "a.py")
    assert _offences("q = f'''UPDATE tidal_batch_chunks SET state = {s!r}'''\n", "a.py")
    assert _offences("q = ('DELETE FROM tidal_files '\n     'WHERE id = :i')\n", "a.py")
    # Not SQL: prose, metric names, a function of one's own called text.
    assert not _offences('"""Rows FROM tidal_workers, described."""\n', "a.py")
    assert not _offences("m = 'tidal_worker_chunks_total'\n", "a.py")
    assert not _offences("def text(n: int) -> str:\n    return 'x' * n\ntext(3)\n", "a.py")


@pytest.mark.parametrize("package", PACKAGES)
def test_sql_that_names_a_table_lives_in_the_data_layer(package: str) -> None:
    bad: list[str] = []
    for path in sorted((ROOT / package).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if not _allowed(rel):
            bad += _offences(path.read_text(), rel)
    assert not bad, "SQL outside batch_jobs/queries.py (move it there):\n" + "\n".join(bad)
