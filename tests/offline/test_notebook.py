"""The memory-timeline notebook runs top to bottom on a small trace (so it cannot rot)."""

import json
import sys
from pathlib import Path

import pytest

# colo's dev extra installs these (pip install -e '.[dev]', the README's test command); a
# machine without them (the GPU image, which runs only the gpu tests) skips the notebook
nbformat = pytest.importorskip("nbformat", reason="the notebook test needs colo's dev extra (nbformat)")
pytest.importorskip("nbclient", reason="the notebook test needs colo's dev extra (nbclient)")

from jupyter_client.kernelspec import KernelSpec, KernelSpecManager  # noqa: E402
from jupyter_client.manager import KernelManager  # noqa: E402
from nbclient import NotebookClient  # noqa: E402

from tests.offline.test_export import record_pipelined

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "memory_timeline.ipynb"


class ThisPython(KernelSpecManager):
    """The python3 kernel of the interpreter running the tests, from ipykernel
    itself: no ``ipykernel install`` needed on a fresh machine, and never a
    different ``python`` found on PATH."""

    def get_kernel_spec(self, kernel_name):
        from ipykernel.kernelspec import get_kernel_dict

        return KernelSpec(resource_dir="", **get_kernel_dict())


def execute(trace, figure, monkeypatch):
    monkeypatch.setenv("COLO_TRACE", str(trace))
    monkeypatch.setenv("COLO_FIGURE", str(figure))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    km = KernelManager(kernel_name="python3", kernel_spec_manager=ThisPython())
    NotebookClient(nb, km=km, timeout=120, resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    return nb


def outputs(nb):
    return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]


async def test_notebook_plots_memory_phases_and_the_bucket_pipeline(tmp_path, monkeypatch):
    trace = await record_pipelined(tmp_path / "p.jsonl", cycles=2)
    nb = execute(trace, tmp_path / "fig.png", monkeypatch)
    outs = outputs(nb)
    assert not [o for o in outs if o.output_type == "error"]
    assert any(o.output_type == "display_data" and "image/png" in o.data for o in outs)
    assert (tmp_path / "fig.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = "".join(o.get("text", "") for o in outs if o.output_type == "stream")
    facts = json.loads(text.strip().splitlines()[-1])
    assert facts["phase_bands"] == 16 and facts["axes"] == 2
    # three buckets per sync, each overlapping the next two: three lanes, 5 stages each
    assert (facts["bucket_slices"], facts["stage_slices"], facts["lanes"]) == (6, 30, 3)
    assert facts["tags"] == ["engine.cuda_graph", "engine.kv_cache", "engine.weights", "staging",
                             "trainer.optimizer", "trainer.weights"]
    assert facts["peaks"]["used"] == [420, "start"]
    assert facts["peaks"]["trainer.optimizer"] == [200, "trainer_onload"]
    assert "p.jsonl: 88 events, rank 0, plan offload-first" in text


def test_notebook_names_the_missing_trace(tmp_path, monkeypatch):
    # the loading cell alone, in this process: a second kernel start would cost seconds
    monkeypatch.setenv("COLO_TRACE", str(tmp_path / "nope.jsonl"))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.chdir(NOTEBOOK.parent)
    load = next(c for c in nbformat.read(NOTEBOOK, as_version=4).cells if c.cell_type == "code")
    with pytest.raises(FileNotFoundError, match="no trace at .*nope.jsonl: record one with `colo demo --trace"):
        exec(compile(load.source, "memory_timeline.ipynb", "exec"), {})


def test_the_notebook_is_committed_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    assert all(not c.get("outputs") and c.get("execution_count") is None
               for c in nb.cells if c.cell_type == "code")
    assert nb.metadata.kernelspec.name == "python3" and sys.version_info >= (3, 10)


#: issue 17's GPU round trip, recorded on one H100 (``bench/gpu_run.sh tune-test``)
GPU_TRACE = NOTEBOOK.parents[1] / "traces" / "gpu-tune-baseline.jsonl"


def test_notebook_draws_the_gpu_trace_with_the_kv_pool_at_the_recommended_fraction(monkeypatch, capsys):
    # every code cell in this process (no kernel start: seconds of CI), as the default trace
    from colo.offline.tune import tune
    from colo.offline.replay import load_trace

    monkeypatch.delenv("COLO_TRACE", raising=False)
    monkeypatch.delenv("COLO_FIGURE", raising=False)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.chdir(NOTEBOOK.parent)
    scope: dict = {}
    for cell in nbformat.read(NOTEBOOK, as_version=4).cells:
        if cell.cell_type == "code":
            exec(compile(cell.source, "memory_timeline.ipynb", "exec"), scope)
    facts = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rec = tune([load_trace(GPU_TRACE)])
    assert scope["TRACE"] == GPU_TRACE and scope["device"][0]["args"]["total"] > 70 << 30
    assert facts["recommended"] == rec.mem_fraction_static and facts["binding_phase"] == "engine_wake_kv"
    # the dotted line: the recorded memory with the KV pool swapped for the one at the recommendation
    r = rec.results[0]
    kv_at = rec.mem_fraction_static * r.device.total - r.device.engine_weights
    peak = max(p.used - p.kv + kv_at for p in r.device.points if p.kv_resident and not p.virtual)
    assert abs(facts["max_at_recommended"] - peak) <= 1 << 20
    assert facts["max_at_recommended"] <= r.device.total - r.margin
    line = [ln for ln in scope["ax"].get_lines() if "recommended" in ln.get_label()]
    assert len(line) == 1
