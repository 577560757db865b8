"""Regenerate the README's phase diagram from the table: ``python -m tools.readme``."""

import re
import sys
from pathlib import Path

from colo.core.phases import mermaid


def main(path: str = "README.md") -> int:
    readme = Path(path)
    text = readme.read_text(encoding="utf-8")
    new, n = re.subn(r"```mermaid\n.*?```", lambda _: "```mermaid\n" + mermaid() + "```", text, count=1, flags=re.S)
    if n != 1:
        print(f"{path}: no ```mermaid block to replace", file=sys.stderr)
        return 2
    readme.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
