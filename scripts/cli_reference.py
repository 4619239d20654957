"""Write the CLI reference into docs/cli.md from the commands' own --help (a test checks that
the page matches, so the two never drift apart).

    python scripts/cli_reference.py          # rewrite the block
    python scripts/cli_reference.py --check  # exit 1 if the page is stale
"""

from __future__ import annotations

import sys
from pathlib import Path

from click.testing import CliRunner

from shardkit.cli import main

PAGE = Path(__file__).resolve().parent.parent / "docs" / "cli.md"
START, END = "<!-- cli-reference:start -->", "<!-- cli-reference:end -->"


def reference() -> str:
    runner = CliRunner()
    parts = []
    for command in ["", *sorted(main.commands)]:
        args = [command, "--help"] if command else ["--help"]
        out = runner.invoke(main, args, prog_name="shardkit", terminal_width=100).output
        parts.append(f"```\n$ shardkit {command + ' ' if command else ''}--help\n{out.rstrip()}\n```")
    return "\n\n".join(parts)


def rendered(page: str) -> str:
    head, rest = page.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{reference()}\n{END}{tail}"


if __name__ == "__main__":
    text = PAGE.read_text()
    new = rendered(text)
    if "--check" in sys.argv:
        sys.exit(0 if new == text else 1)
    PAGE.write_text(new)
