"""SGLang's own code, from its published wheel, for the tests that check colo against it.

The wheel of ``sglang==SGLANG_VERSION`` is downloaded once into the gitignored
``.cache/sglang/`` (``pip download --no-deps``); a failed download fails the test, it
never skips it. Two ways to run what it ships:

- :func:`load_file`: one file that imports only what is allowed (``tensor_bucket.py``
  imports dataclasses, typing and torch), executed under a private name.
- :func:`import_sglang`: SGLang's modules by their own names from the unpacked wheel,
  for files whose imports reach the rest of SGLang. SGLang 0.5.23 cannot be imported
  whole here (it needs torch 2.14.1, a CUDA ``sgl_kernel``, triton, torchvision): its
  package ``__init__`` (the public ``sglang`` API: ``sglang.lang``, transformers
  patches) is not run, and only the modules named in :data:`STUBS` are replaced by
  empty modules, each with the reason it is unrelated to what is checked. Everything
  else that is imported is SGLang's own file.
"""

from __future__ import annotations

import ast
import importlib
import importlib.abc
import importlib.util
import shutil
import subprocess
import sys
import tempfile
import types
import zipfile
from pathlib import Path

import pytest

SGLANG_VERSION = "0.5.23"
#: one fixed wheel of that release, whatever machine runs the test: only pure-Python files are read
WHEEL_PLATFORM, WHEEL_PYTHON = "manylinux_2_34_x86_64", "3.11"
CACHE = Path(__file__).resolve().parents[1] / ".cache" / "sglang"
TREE = CACHE / SGLANG_VERSION / "tree"

#: module (and its submodules) -> why an empty module stands in for it. Nothing that
#: colo's requests, payloads or session order pass through is in here.
STUBS = {
    # a hard `import triton` at the top of utils/common.py (for GPU kernels; triton is not
    # installed on a CPU machine): nothing checked calls a triton kernel
    "triton": "GPU kernel compiler imported by sglang/srt/utils/common.py:91",
    # `from starlette.routing import Mount` in utils/common.py, for the HTTP server's mounts
    "starlette": "HTTP framework imported by sglang/srt/utils/common.py:95 for route mounts",
    # io_struct.py:58 imports multimodal / hidden-state enums from it; schedule_batch imports the
    # forward-batch machinery, which reaches sgl_kernel and tvm_ffi
    "sglang.srt.managers.schedule_batch": "io_struct.py:58 (Modality, MultimodalProcessorOutput, "
                                          "ReturnHiddenStatesMode, SamplingLogprobsMode, "
                                          "get_return_hidden_states_mode: multimodal and hidden-state "
                                          "options colo never sets); importing it reaches tvm_ffi",
    # model configs (transformers' AutoProcessor for VL models): the disaggregation utils the
    # session manager imports reach them
    "sglang.srt.configs": "model configs reached through sglang/srt/disaggregation/utils.py:24; they need "
                          "transformers==5.19 (AutoProcessor of VL models)",
    # the weight checker's checksums, imported by the session manager only for overall_checksum
    "sglang.srt.utils.weight_checker": "scheduler_components/weight_updater.py:48 imports overall_checksum "
                                       "from it (the /weights_checker reply, not the session); importing it "
                                       "reaches the quantization layers and tvm_ffi",
}


def wheel() -> Path:
    found = sorted(CACHE.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    if found:
        return found[0]
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--platform", WHEEL_PLATFORM, "--python-version", WHEEL_PYTHON,
               f"sglang=={SGLANG_VERSION}", "-d", tmp]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            pytest.fail(f"downloading sglang=={SGLANG_VERSION} from PyPI timed out after 600 s "
                        f"(command: {' '.join(cmd)})")
        got = sorted(Path(tmp).glob(f"sglang-{SGLANG_VERSION}-*.whl"))
        if done.returncode != 0 or not got:
            pytest.fail(f"could not download SGLang's wheel sglang=={SGLANG_VERSION} from PyPI, which these "
                        f"tests need (pip exit {done.returncode}; command: {' '.join(cmd)}):\n"
                        f"{(done.stderr or done.stdout)[-2000:]}")
        # renamed into place whole: a second run never sees half a wheel
        target = CACHE / got[0].name
        shutil.move(str(got[0]), target)
    return target


def member(path: str) -> Path:
    """One file of the wheel, extracted under the cache."""
    out = CACHE / SGLANG_VERSION / path
    if not out.exists():
        w = wheel()
        with zipfile.ZipFile(w) as z:
            try:
                source = z.read(path)
            except KeyError:
                pytest.fail(f"{w.name} has no {path}: SGLang moved it; check the new location and update the test")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        tmp.write_bytes(source)
        tmp.replace(out)
    return out


def imports_of(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            found.add("." * node.level + (node.module or ""))
    return found


def load_file(path: str, allowed: set[str], name: str) -> types.ModuleType:
    """One file of the wheel as a module of its own (``name``), after checking that it
    imports nothing beyond ``allowed``."""
    out = member(path)
    extra = sorted(m for m in imports_of(out) if m.split(".")[0] not in allowed)
    if extra:
        pytest.fail(f"{path} in sglang=={SGLANG_VERSION} imports {extra}, beyond {sorted(allowed)}; "
                    f"load those files from the same wheel too before running it")
    spec = importlib.util.spec_from_file_location(name, out)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(name, None)
    return module


def tree() -> Path:
    """The wheel's ``sglang/`` package unpacked (once) under the cache."""
    done = TREE / ".complete"
    if not done.exists():
        w = wheel()
        tmp = Path(tempfile.mkdtemp(dir=CACHE))
        with zipfile.ZipFile(w) as z:
            z.extractall(tmp, [n for n in z.namelist() if n.startswith("sglang/") and n.endswith(".py")])
        shutil.rmtree(TREE, ignore_errors=True)
        TREE.parent.mkdir(parents=True, exist_ok=True)
        tmp.rename(TREE)
        done.touch()
    return TREE


class _Stub(types.ModuleType):
    """An empty module: any name imported from it is an inert class."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (), {"__init__": lambda self, *a, **k: None, "__call__": lambda self, *a, **k: None})
        setattr(self, name, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if any(fullname == s or fullname.startswith(s + ".") for s in STUBS):
            return importlib.util.spec_from_loader(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Stub(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


_imported: dict[str, types.ModuleType] = {}


def import_sglang(*names: str) -> list[types.ModuleType]:
    """SGLang's modules by their own names, from the unpacked wheel (see the module doc).

    They stay in ``sys.modules`` (SGLang's own unpickler imports its metadata class by
    name); the stand-ins of :data:`STUBS` do not outlive the import, and neither does
    the search path."""
    missing = [n for n in names if n not in _imported]
    if missing:
        root = str(tree())
        if "sglang" in sys.modules and getattr(sys.modules["sglang"], "__path__", None) != [root + "/sglang"]:
            pytest.fail("another sglang is already imported in this process")
        # torch decides once whether triton exists: let it decide before a stand-in is there
        import torch._dynamo  # noqa: F401
        import torch._inductor  # noqa: F401

        pkg = types.ModuleType("sglang")
        pkg.__path__ = [root + "/sglang"]  # the package, without its public-API __init__
        sys.modules.setdefault("sglang", pkg)
        finder = _StubFinder()
        sys.meta_path.insert(0, finder)
        sys.path.insert(0, root)
        try:
            for n in missing:
                try:
                    _imported[n] = importlib.import_module(n)
                except Exception as e:  # noqa: BLE001 (named in the failure)
                    pytest.fail(f"SGLang {SGLANG_VERSION}'s {n} did not import from its wheel with "
                                f"{sorted(STUBS)} stubbed: {type(e).__name__}: {e}")
        finally:
            sys.meta_path.remove(finder)
            sys.path.remove(root)
            for key in [k for k in sys.modules if any(k == s or k.startswith(s + ".") for s in STUBS)]:
                if not key.startswith("sglang."):
                    del sys.modules[key]
    return [_imported[n] for n in names]
