"""The README, ``docs/`` and ``deploy/``'s pages quote only what exists.

* every relative link (and image) resolves to a file, and to a heading of it when it names one
  (GitHub's anchors);
* every ``scripts/NAME`` they quote is a file;
* every ``tidal ...`` command they quote -- in code spans, and in ``bash``/``console`` blocks --
  names commands that exist, with options those commands take (a benchmark's options are its
  ``run`` parameters), and ``--help`` on it succeeds.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from tidal.bench import BENCHMARKS
from tidal.cli import cli
from tidal.cli.bench import bench_options

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "deploy").rglob("*.md"))]
_FENCE = re.compile(r"^(`{3,}|~{3,})\s*(\S*)")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_SPAN = re.compile(r"(?<!`)`([^`]+)`(?!`)")
_SHELL = {"bash", "sh", "shell", "console"}


def _split(text: str) -> tuple[str, list[tuple[str, list[str]]]]:
    """The page's prose (fenced blocks blanked, line numbers kept) and its fenced blocks
    (info string, lines)."""
    prose: list[str] = []
    blocks: list[tuple[str, list[str]]] = []
    fence: str | None = None
    for line in text.split("\n"):
        m = _FENCE.match(line.strip())
        if fence is None and m:
            fence = m.group(1)[0] * 3
            blocks.append((m.group(2).lower(), []))
            prose.append("")
        elif fence is not None:
            if line.strip().startswith(fence):
                fence = None
            else:
                blocks[-1][1].append(line)
            prose.append("")
        else:
            prose.append(line)
    return "\n".join(prose), blocks


@cache
def _anchors(path: Path) -> frozenset[str]:
    """GitHub's anchors for the page's headings (duplicates get -1, -2, ...)."""
    prose, _ = _split(path.read_text())
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in prose.split("\n"):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return frozenset(out)


def _links(page: Path) -> Iterator[str]:
    prose, _ = _split(page.read_text())
    prose = _SPAN.sub("", prose)
    for m in _LINK.finditer(prose):
        target = m.group(1)
        if not re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            yield target


def _quoted(page: Path) -> Iterator[str]:
    """Every command line the page quotes: code spans, and the lines of shell blocks
    (continuations joined; in ``console`` blocks only the ``$`` lines)."""
    prose, blocks = _split(page.read_text())
    for m in _SPAN.finditer(prose):
        yield " ".join(m.group(1).split())
    for info, lines in blocks:
        if info not in _SHELL:
            continue
        joined: list[str] = []
        for line in lines:
            if joined and joined[-1].endswith("\\"):
                joined[-1] = joined[-1][:-1] + " " + line.strip()
            else:
                joined.append(line.strip())
        for line in joined:
            if info == "console":
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            yield line


def _commands(page: Path) -> Iterator[list[str]]:
    """The ``tidal ...`` commands quoted, as argument lists (after ``tidal``)."""
    for line in _quoted(page):
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue  # prose in a code span, not a command
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
            words.pop(0)  # VAR=value before the command
        if len(words) >= 2 and words[0] == "tidal":
            yield [w.strip("[]") for w in words[1:]]


def _placeholder(word: str) -> bool:
    return word == "..." or bool(re.fullmatch(r"[A-Z][A-Z0-9_]*", word))


def _options(command: click.Command) -> dict[str, bool]:
    """Option name -> whether it takes a value."""
    out: dict[str, bool] = {}
    for p in command.get_params(click.Context(command)):
        if isinstance(p, click.Option):
            for name in (*p.opts, *p.secondary_opts):
                out[name] = not (p.is_flag or p.count)
    return out


def _name(path: list[str]) -> str:
    return " ".join(["tidal", *path])


def _check(args: list[str]) -> tuple[list[str], list[str]]:
    """The command path ``args`` names and what is wrong with it."""
    problems: list[str] = []
    command: click.Command = cli
    path: list[str] = []
    ctx = click.Context(cli)
    i = 0
    while i < len(args):
        word = args[i]
        if word == "...":
            break
        if word.startswith("-"):
            name = word.split("=", 1)[0]
            options = _options(command)
            if name in options:
                i += 2 if options[name] and "=" not in word else 1
                continue
            if command.name == "bench" and len(path) == 1 and name.startswith("--"):
                bench_name = next((a for a in args[: i + 1] if a in BENCHMARKS), None)
                if bench_name is not None:
                    module, func = BENCHMARKS[bench_name].split(":")
                    run = getattr(__import__(module, fromlist=[func]), func)
                    if name[2:].replace("-", "_") in bench_options(run):
                        i += 1 if i + 1 >= len(args) or args[i + 1].startswith("--") else 2
                        continue
                problems.append(f"tidal bench {bench_name or '?'}: no option {name}")
            elif not command.context_settings.get("ignore_unknown_options"):
                problems.append(f"{_name(path)}: no option {name}")
            i += 1 if "=" in word or i + 1 >= len(args) or args[i + 1].startswith("-") else 2
            continue
        if isinstance(command, click.Group):
            sub = command.get_command(ctx, word)
            if sub is not None:
                command = sub
                path.append(word)
                i += 1
                continue
            if not _placeholder(word) and not any(isinstance(p, click.Argument) for p in command.params):
                problems.append(f"{_name(path)}: no command {word!r}")
                break
        elif command.name == "bench" and len(path) == 1 and not _placeholder(word) and word not in BENCHMARKS:
            problems.append(f"tidal bench: no benchmark {word!r}")
        i += 1
    return path, problems


def test_pages_exist() -> None:
    assert (ROOT / "docs" / "architecture.md") in PAGES
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(page: Path) -> None:
    broken = []
    for target in _links(page):
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor}")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_scripts_exist(page: Path) -> None:
    named = {m for line in _quoted(page) for m in re.findall(r"(?<![\w/])scripts/[\w.-]+", line)}
    missing = sorted(s for s in named if not (ROOT / s).is_file())
    assert not missing, f"{page.relative_to(ROOT)} quotes {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_quoted_commands_exist(page: Path) -> None:
    runner = CliRunner()
    problems: list[str] = []
    helped: set[tuple[str, ...]] = set()
    for args in _commands(page):
        path, wrong = _check(args)
        problems += [f"`tidal {' '.join(args)}`: {w}" for w in wrong]
        if tuple(path) not in helped:
            helped.add(tuple(path))
            result = runner.invoke(cli, [*path, "--help"])
            if result.exit_code != 0:
                problems.append(f"tidal {' '.join(path)} --help: exit {result.exit_code}")
    assert not problems, f"{page.relative_to(ROOT)}:\n" + "\n".join(problems)


def test_the_checker_catches_what_it_should() -> None:
    """A command, option or benchmark option that does not exist is reported; real ones are not."""
    assert _check(["gateway", "--config", "FLEET", "--port", "8000"]) == (["gateway"], [])
    assert _check(["bench", "routing", "--trace", "F", "--loads", "0.8", "--quick"])[1] == []
    assert _check(["bench", "NAME", "--quick"])[1] == []
    assert _check(["gatewya", "--port", "1"])[1]
    assert _check(["gateway", "--prot", "1"])[1]
    assert _check(["bench", "routing", "--trcae", "F"])[1]
    assert _check(["bench", "nosuch"])[1]
    assert _anchors(ROOT / "docs" / "gateway.md") >= {"several-gateways-several-processes"}
