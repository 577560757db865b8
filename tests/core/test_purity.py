import pkgutil
import subprocess
import sys

import pytest

import colo.core

FORBIDDEN = ["torch", "torch.cuda", "anyio", "torch_memory_saver", "structlog"]
#: every module of the pure core, found on disk: a new module is checked without being listed
CORE = sorted(f"colo.core.{m.name}" for m in pkgutil.iter_modules(colo.core.__path__))
#: pure modules outside the core package: errors, and the offline tools over traces
OFFLINE = ["colo.core.errors", "colo.offline.replay", "colo.offline.tune", "colo.offline.export",
           "colo.offline.summary",
           # the architecture table and the checkpoint checks: data, read by engines' workers too
           "colo.models", "colo.models.arch", "colo.models.checkpoint", "colo.models.specs"]


def _pulled_in(modules: list[str]) -> str:
    code = (f"import sys; import {', '.join(modules)}; "
            f"print(','.join(m for m in {FORBIDDEN!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_the_core_package_has_the_modules_the_design_names():
    names = {m.rsplit(".", 1)[1] for m in CORE}
    assert {"phases", "invariants", "memory", "buckets", "config", "schema", "interfaces", "units"} <= names


def test_every_core_module_together_imports_no_torch_anyio_or_structlog():
    assert _pulled_in(CORE) == "", "the pure core pulled in a forbidden module"


@pytest.mark.parametrize("module", CORE + OFFLINE)
def test_each_pure_module_alone_imports_no_torch_anyio_or_structlog(module):
    assert _pulled_in([module]) == "", f"{module} pulled in a forbidden module"


def test_the_check_itself_sees_a_forbidden_import():
    # the scheduler does import anyio: the probe above must be able to tell
    assert "anyio" in _pulled_in(["colo.scheduler"]).split(",")


def test_the_command_line_is_imported_by_no_module_of_the_library():
    import pathlib
    import re

    root = pathlib.Path(colo.core.__path__[0]).parent
    users = [str(p.relative_to(root.parent)) for p in root.rglob("*.py")
             if p.name != "cli.py" and re.search(r"^\s*(from colo\.cli|import colo\.cli)", p.read_text(), re.M)]
    assert users == []
