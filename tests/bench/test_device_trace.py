"""``python -m bench.device_trace``: a Chrome trace's device work summed (span, busy, idle, copies by size)."""

import json

import pytest

from bench.device_trace import main, summarize


def _ev(cat, name, ts, dur, nbytes=0):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 7,
            "args": {"bytes": nbytes} if nbytes else {}}


TRACE = {"traceEvents": [
    # host ops are not device work
    {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "ts": 0, "dur": 500, "pid": 1, "tid": 1},
    _ev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 100, 200, 10 << 20),  # 100-300
    _ev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 310, 5, 1024),        # idle 10 before it
    _ev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 312, 8, 2048),        # overlaps: busy to 320
    _ev("kernel", "copy_kernel", 370, 30),                                     # idle 50 before it
]}


def test_span_busy_idle_and_the_copies_by_size_class_are_the_traces():
    s = summarize(TRACE)
    assert s["events"] == 4
    assert s["span_ms"] == pytest.approx(0.300) and s["busy_ms"] == pytest.approx(0.240)
    assert s["idle_ms"] == pytest.approx(0.060)
    rows = {(r["kind"], r["size"]): r for r in s["by_kind"]}
    big = rows[("Memcpy HtoD (Pinned -> Device)", "1 - 16 MiB")]
    small = rows[("Memcpy HtoD (Pinned -> Device)", "< 64 KiB")]
    assert (big["count"], big["bytes"], big["ms"]) == (1, 10 << 20, pytest.approx(0.2))
    assert big["GBps"] == pytest.approx((10 << 20) / 200e3)
    assert (small["count"], small["bytes"], small["ms"]) == (2, 3072, pytest.approx(0.013))
    assert rows[("kernel", "-")]["count"] == 1 and rows[("kernel", "-")]["GBps"] is None
    assert [(g["us"], g["next"]) for g in s["longest_idle"]] == [(50, "copy_kernel"), (10, "Memcpy HtoD (Pinned -> Device)")]


def test_the_command_prints_and_writes_each_trace(tmp_path, capsys):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(TRACE))
    empty = tmp_path / "e.json"
    empty.write_text(json.dumps({"traceEvents": []}))
    assert main([str(path), str(empty), "--json", str(tmp_path / "out.json")]) == 0
    out = json.loads((tmp_path / "out.json").read_text())
    assert out[str(path)] == summarize(TRACE) and out[str(empty)] == {"events": 0}
    printed = capsys.readouterr().out
    assert "4 device events: span 0.30 ms, busy 0.24, idle 0.06" in printed and "no device events" in printed
