import subprocess
import sys

import pytest

PURE = ["colo.core.phases", "colo.core.invariants", "colo.core.buckets", "colo.core.memory", "colo.core.schema", "colo.core.config"]
FORBIDDEN = ["torch", "torch.cuda", "anyio", "torch_memory_saver", "structlog"]


@pytest.mark.parametrize("module", PURE)
def test_core_module_imports_no_torch_anyio_or_memory_saver(module):
    code = (f"import sys, {module}; "
            f"print(','.join(m for m in {FORBIDDEN!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"{module} pulled in {out.stdout.strip()}"


def test_the_check_itself_sees_a_forbidden_import():
    # the scheduler does import anyio: the probe above must be able to tell
    code = "import sys, colo.scheduler; print('anyio' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
