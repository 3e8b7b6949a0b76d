"""`python -m ktlite.launch_server ...` = `ktlite serve ...` (the SGLang `python -m sglang.launch_server` habit)."""

from __future__ import annotations

import sys


def run(argv: list[str] | None = None) -> None:
    from ktlite.cli import main

    main(["serve", *(sys.argv[1:] if argv is None else argv)], prog_name="python -m ktlite.launch_server")


if __name__ == "__main__":
    run()
