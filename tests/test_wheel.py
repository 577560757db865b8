"""colo as a user gets it: the distribution ``colo-rl``, built by ``python -m build`` into an
sdist and a wheel, the wheel installed into a fresh virtual environment and ``colo demo`` run
from there rather than from this checkout. And no install line names ``colo``: on the
package index that is another project (a script that prints the terminal's 256 colors)."""

from __future__ import annotations

import os
import re
import shutil
import site
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import colo

REPO = Path(__file__).resolve().parents[1]
DIST = "colo-rl"
WHEEL = f"colo_rl-{colo.__version__}-py3-none-any.whl"
SDIST = f"colo_rl-{colo.__version__}.tar.gz"
#: hang guards only, far above what a busy two-core machine takes (build 10 s, venv 10 s,
#: the demo's two steps 40 s): no verdict here depends on the machine's speed
CEILING_S = 900

#: what users read: the README, the changelog, the guides, every message the package prints
READ = [REPO / "README.md", REPO / "CHANGELOG.md", REPO / "pyproject.toml", *sorted((REPO / "docs").glob("*.md")),
        *sorted((REPO / "colo").rglob("*.py"))]
#: an extra of the old name (``colo[vllm]``), or an install of it by name (``pip install 'colo'``)
OLD_NAME = re.compile(r"""(?<![\w.-])colo\[|pip install\s+(?:-\S+\s+)*['"]?colo(?![\w.-])""")
EXTRA = re.compile(rf"{DIST}\[([\w-]+)\]")


def test_no_install_line_names_the_other_projects_colo():
    found = [f"{path.relative_to(REPO)}:{n}: {line.strip()}" for path in READ
             for n, line in enumerate(path.read_text().splitlines(), 1) if OLD_NAME.search(line)]
    assert found == []
    # (the command line's hint for a missing extra: tests/test_cli.py)
    assert f'\nname = "{DIST}"\n' in (REPO / "pyproject.toml").read_text()


def test_the_changelog_has_an_entry_for_this_version():
    headings = re.findall(r"^## (\S+)", (REPO / "CHANGELOG.md").read_text(), re.M)
    assert headings[:2] == ["Unreleased", colo.__version__]


def _clean_env(**extra: str) -> dict:
    """This environment without what would point a child at this checkout or another env."""
    drop = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "PYTHONNOUSERSITE")
    return {**{k: v for k, v in os.environ.items() if k not in drop}, "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            **extra}


def _run(argv: list, cwd: Path, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in argv], cwd=cwd, env=_clean_env(), capture_output=True, text=True,
                          timeout=CEILING_S, **kw)
    assert proc.returncode == 0, f"{argv}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """The sdist and the wheel, as ``python -m build`` makes them: the sdist from the source, the
    wheel from the unpacked sdist (so the sdist must hold all the wheel needs). The source is a
    copy of what the build reads (the top-level files and the package), so the build writes
    nothing into this checkout; it runs with this environment's setuptools (the dev extra's),
    no index needed."""
    try:
        import build  # noqa: F401
    except ImportError:
        pytest.fail("the dev extra's `build` is not installed: pip install -e '.[dev]'")
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    src.mkdir()
    for path in REPO.iterdir():
        if path.is_file() and not path.name.startswith("."):
            shutil.copy2(path, src / path.name)
    shutil.copytree(REPO / "colo", src / "colo", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", root / "dist", src], cwd=root)
    assert sorted(p.name for p in (root / "dist").iterdir()) == sorted([SDIST, WHEEL])
    return root


def test_the_sdist_holds_the_package_and_its_description(built):
    with tarfile.open(built / "dist" / SDIST) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert {"pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md", "PKG-INFO", "colo/__init__.py",
            "colo/cli.py", "colo/core/phases.py"} <= names
    package = {p.relative_to(REPO).as_posix() for p in (REPO / "colo").rglob("*.py")}
    assert package <= names
    assert not [n for n in names if n.startswith("tests/")]


def test_the_wheel_is_the_whole_package_under_its_name(built):
    with zipfile.ZipFile(built / "dist" / WHEEL) as whl:
        names = set(whl.namelist())
        info = f"colo_rl-{colo.__version__}.dist-info"
        metadata = whl.read(f"{info}/METADATA").decode()
        entry_points = whl.read(f"{info}/entry_points.txt").decode()
    # every module, subpackages included (a folder without __init__.py would be left out)
    assert {p.relative_to(REPO).as_posix() for p in (REPO / "colo").rglob("*.py")} <= names
    assert not [n for n in names if not (n.startswith("colo/") or n.startswith(info))]
    headers = [line.split(": ", 1) for line in metadata.split("\n\n", 1)[0].splitlines() if ": " in line]
    assert ["Name", DIST] in headers and ["Version", colo.__version__] in headers
    assert ["License-Expression", "Apache-2.0"] in headers
    extras = {v for k, v in headers if k == "Provides-Extra"}
    # every extra an install line or a hint names is one the wheel provides
    named = {m for path in READ for m in EXTRA.findall(path.read_text())}
    assert {"gpu", "vllm", "megatron", "ray", "sglang"} <= named <= extras
    assert re.search(r"^colo = colo\.cli:run$", entry_points, re.M)


def test_the_wheel_in_a_fresh_venv_runs_the_demo(built, tmp_path):
    """A fresh venv with the wheel installed, colo imported from the venv (not this checkout)
    and ``colo demo --steps 2`` run by the venv's own ``colo`` command. The heavy dependencies
    (torch, transformers, ...) are not installed again: the venv sees this environment's
    site-packages after its own, as ``--system-site-packages`` would if this environment is
    not itself a venv, and pip checks the wheel's requirements against them with no index."""
    venv = tmp_path / "venv"
    # no pip of its own: on Python 3.11 that would bring an old setuptools of its own too, which
    # shadows this environment's and fails torch's requirement (setuptools>=77); this
    # environment's pip installs into it (--python)
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp_path)
    py = venv / "bin" / "python"
    purelib = Path(_run([py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                        cwd=tmp_path).stdout.strip())
    here = [*site.getsitepackages()]
    if site.ENABLE_USER_SITE and os.path.isdir(site.getusersitepackages()):
        here.append(site.getusersitepackages())
    # .pth lines that start with "import" are run: addsitedir also reads those dirs' own .pth files
    (purelib / "_this_test_borrows.pth").write_text("".join(f"import site; site.addsitedir({d!r})\n" for d in here))

    install = _run([sys.executable, "-m", "pip", "--python", py, "install", "--no-index", built / "dist" / WHEEL],
                   cwd=tmp_path)
    assert f"Successfully installed {DIST}-{colo.__version__}" in install.stdout, install.stdout[-2000:]

    where = _run([py, "-c", "import colo, importlib.metadata as m; print(colo.__file__); "
                            "print(m.distribution('colo-rl').locate_file('colo/__init__.py'))"], cwd=tmp_path)
    module, recorded = where.stdout.split()
    assert Path(module) == purelib / "colo" / "__init__.py" == Path(recorded)

    trace = tmp_path / "demo.jsonl"
    demo = _run([venv / "bin" / "colo", "demo", "--steps", "2", "--quiet", "--trace", trace], cwd=tmp_path)
    assert "reward per step" in demo.stdout and f"trace: {trace}" in demo.stdout
    events = [re.search(r'"event":\s*"([a-z._]+)"', line).group(1) for line in trace.read_text().splitlines()]
    assert events[0] == "trace.started" and events[-1] == "trace.finished"
    assert events.count("rollout.finished") == 2 and events.count("sync.finished") >= 1
    assert "phase.failed" not in events
    _run([venv / "bin" / "colo", "replay", trace], cwd=tmp_path)
