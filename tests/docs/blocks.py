"""The code blocks of the README and docs/, and how each is run as written.

A block is a fenced ``bash``/``python`` block (``text``, ``mermaid`` and ``json`` are
not code). Its first line may say where it runs:

- ``# on a GPU machine`` / ``# needs a Ray cluster``: run where that exists; elsewhere
  each ``colo`` command in it is parsed by colo's own parser (its flags exist and
  take those values) and nothing runs;
- ``# needs vLLM``: run in vLLM's environment (``tests/vllm/test_docs.py``).

A ``bash`` block runs line by line (a trailing ``\\`` continues a line; ``&&`` chains
are split), in a scratch directory holding a copy of the repository's ``traces/``,
with the checkout on ``PYTHONPATH``. A line may end with ``# exits N`` (the status it
must end with, else 0). Two kinds of line are not run here because the README's test
command, which CI runs, is them: ``pip install ...`` and the test command itself
(the line ``.ci/run`` ends with; the test checks the two are the same line).
A ``python`` block runs as a script.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MARKS = ("# on a GPU machine", "# needs a Ray cluster", "# needs vLLM")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    lang: str
    text: str

    @property
    def mark(self) -> str | None:
        first = self.text.splitlines()[0] if self.text.strip() else ""
        return next((m for m in MARKS if first.startswith(m)), None)

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def blocks() -> list[Block]:
    out = []
    for path in DOCS:
        lines = path.read_text(encoding="utf-8").splitlines()
        i = 0
        while i < len(lines):
            m = re.match(r"^```(\w*)\s*$", lines[i])
            if not m:
                i += 1
                continue
            start, lang = i, m.group(1)
            i += 1
            body = []
            while i < len(lines) and not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            i += 1
            if lang in ("bash", "sh", "python"):
                out.append(Block(path, start + 1, lang, "\n".join(body) + "\n"))
    return out


#: the README's first command: ``tests/apps/test_demo.py`` runs it as written (the default demo,
#: about a minute on a busy two-core machine) and holds it to what it prints, so the block test
#: does not run it a second time
README_DEMO = "pip install torch==2.13.0 -e . && colo demo"
#: the README's LoRA command: ``tests/apps/test_demo_lora.py`` runs it as written (thirty adapter
#: syncs) and holds it to what it does, so the block test does not run it a second time
README_LORA = "colo demo --lora-rank 8 --steps 30"
#: docs/multi-gpu.md's CPU run of the multi-rank benchmark: ``tests/bench/test_multi_gpu.py`` runs
#: it as written and checks every row it writes (282 s of a pytest worker as a block of its own, beside
#: the same benchmark in that test, in the fresh-clone run under load of 2026-11-30)
MULTI_GPU_TINY = ("python -m bench.multi_gpu --device cpu --gpus 2 --model tiny --reps 1 --bucket-mib 0.5 "
                  "--out multi-gpu-tiny.json")
#: command lines of the docs that another test runs exactly as written, and which test: the block
#: test leaves them to it (tests/docs/test_code_blocks.py checks each test still runs its line)
HELD = {README_DEMO: "tests/apps/test_demo.py", README_LORA: "tests/apps/test_demo_lora.py",
        MULTI_GPU_TINY: "tests/bench/test_multi_gpu.py"}


def ci_test_command() -> str:
    """The line ``.ci/run`` runs: the README's test command."""
    lines = [ln for ln in (REPO / ".ci" / "run").read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    return lines[-1].strip()


def commands(block: Block) -> list[tuple[str, int]]:
    """``(command, expected exit status)`` per line of a bash block, continuations joined."""
    out, pending = [], ""
    for raw in block.text.splitlines():
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        line = (pending + raw).strip()
        pending = ""
        if not line or line.startswith("#"):
            continue
        m = re.search(r"#\s*exits\s+(\d+)", line)
        out.append((line.split(" #", 1)[0].strip() if " #" in line else line, int(m.group(1)) if m else 0))
    return out


def scratch(tmp: Path) -> Path:
    """A working directory with the committed traces the blocks read."""
    shutil.copytree(REPO / "traces", tmp / "traces", ignore=shutil.ignore_patterns("*.log"))
    return tmp


def env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "PYTHONUNBUFFERED": "1"}


def run_python(block: Block, cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    script = cwd / f"block_{block.line}.py"
    script.write_text(block.text, encoding="utf-8")
    return subprocess.run([sys.executable, str(script)], cwd=cwd, env=env(), capture_output=True, text=True,
                          timeout=timeout)


def command_env() -> dict:
    """A block's command line's environment: the python that runs the tests is also behind
    ``python`` and ``colo`` in a block."""
    bindir = str(Path(sys.executable).parent)
    return {**env(), "PATH": bindir + os.pathsep + os.environ.get("PATH", "")}


def run_command(cmd: str, cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", cmd], cwd=cwd, env=command_env(), capture_output=True, text=True,
                          timeout=timeout)


def colo_argv(cmd: str) -> list[str] | None:
    """The arguments of a ``colo`` command line (None for any other command)."""
    words = shlex.split(cmd)
    return words[1:] if words and words[0] == "colo" else None
