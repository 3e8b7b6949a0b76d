"""bench/RESULTS.md as the current results: one section per bench script, each replaced by that script's `--write`.

A section sits between `<!-- bench:NAME begin -->` and `<!-- bench:NAME end -->` and says the date, the machine
(CPU model and vector flags from ktlite.machine, the GPU) and the exact command before the bench's own tables. Dated
logs live in bench/history/. Not a benchmark itself (the leading underscore keeps it out of `ktlite bench`).
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import re
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path

from ktlite.machine import cpu_features, cpu_model

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "bench" / "RESULTS.md"


def markers(name: str) -> tuple[str, str]:
    return f"<!-- bench:{name} begin -->", f"<!-- bench:{name} end -->"


def gpu() -> str:
    import torch  # here, not at import: grammar_engines.py has no other use for it

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "none"


def machine() -> str:
    return f"{cpu_model()}, {os.cpu_count()} CPUs, flags: {cpu_features()}; GPU: {gpu()}"


def command(argv: list[str]) -> str:
    """`python bench/X.py ARGS` as typed from the repository root, whichever path started the script."""
    script = Path(argv[0]).resolve()
    shown = script.relative_to(ROOT) if script.is_relative_to(ROOT) else script
    return shlex.join(["python", str(shown), *argv[1:]])


def section(name: str, title: str, body: str, argv: list[str] | None = None,
            machine_line: str | None = None, date: str | None = None) -> str:
    """A bench's section: its title, the date, machine and command, then `body` (its markdown tables)."""
    begin, end = markers(name)
    return (f"{begin}\n## {title}\n\n"
            f"- Date: {date or datetime.date.today().isoformat()}\n"
            f"- Machine: {machine_line or machine()}\n"
            f"- Command: `{command(argv or sys.argv)}`\n\n"
            f"{body.strip()}\n{end}\n")


def markdown_table(header: list[str], rows: list[tuple[str, ...]]) -> str:
    return "\n".join([f"| {' | '.join(header)} |", "|" + "---|" * len(header)] + [f"| {' | '.join(r)} |" for r in rows])


def publish(name: str, title: str, body: str, write: bool) -> None:
    """Print a bench's section and, with `write` (its --write), put it in bench/RESULTS.md."""
    text = section(name, title, body)
    print(text)
    if write:
        write_section(name, text)


def replace_section(page: str, name: str, text: str) -> str:
    """`page` with NAME's section replaced by `text` (appended where it has none); the rest byte for byte."""
    begin, end = markers(name)
    found = re.search(re.escape(begin) + r".*?" + re.escape(end) + r"\n?", page, re.S)
    if found:
        return page[:found.start()] + text + page[found.end():]
    return page.rstrip("\n") + "\n\n" + text


def write_section(name: str, text: str, page: Path = PAGE) -> None:
    page.write_text(replace_section(page.read_text() if page.is_file() else "# Bench results\n", name, text))
    print(f"wrote section {name!r} of {page}")


@contextlib.contextmanager
def recorded() -> Iterator[io.StringIO]:
    """Print as usual and keep a copy: for benches that print their tables row by row as they are measured."""
    copy, out = io.StringIO(), sys.stdout

    class Tee(io.TextIOBase):
        def write(self, s: str) -> int:
            copy.write(s)
            return out.write(s)

        def flush(self) -> None:
            out.flush()

    with contextlib.redirect_stdout(Tee()):
        yield copy
