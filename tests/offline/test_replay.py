"""``colo replay``: real traces from the scheduler and fakes, then mutated ones."""

import json
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from colo.cli import main
from colo.core.config import SchedulerConfig
from colo.core.memory import MemoryLedger, OutOfMemory
from colo.offline.replay import BadTrace, load_trace, replay
from colo.scheduler import Scheduler
from colo.trace.writer import TraceWriter, read_trace
from colo.testing.fakes import FakeEngine, FakeTrainer, FakeTransport


async def record(path, *, plan="offload-first", cycles=2, total=10_000, bucket=50, rank=0,
                 world_size=1, reserved=0, fail=None, run_id=None):
    """Run the scheduler with the fakes and write a real trace to ``path`` (``run_id``: the run
    it is a rank of; a rank of a multi-rank run recorded here on its own is given its run's)."""
    memory = MemoryLedger(total_bytes=total, reserved_bytes=reserved)
    s = Scheduler(FakeTrainer(), FakeEngine(), memory, FakeTransport(),
                  trace=TraceWriter(path, rank=rank, world_size=world_size),
                  config=SchedulerConfig(plan=plan, bucket_bytes=bucket), run_id=run_id)
    async with s:
        for _ in range(cycles):
            try:
                await s.cycle()
            except OutOfMemory:
                if fail != "oom":
                    raise
                break
    return path


def write(path, events, tail=""):
    path.write_text("".join(json.dumps(e) + "\n" for e in events) + tail)
    return path


def run(capsys, *argv):
    code = main(["replay", *map(str, argv)])
    out = capsys.readouterr()
    return code, out.out, out.err


# -- valid traces --------------------------------------------------------------------

@pytest.mark.parametrize("plan", ["offload-first", "sync-first", "single-stage"])
async def test_scheduler_traces_replay_clean_with_a_summary_of_values(plan, tmp_path, capsys):
    path = await record(tmp_path / "t.jsonl", plan=plan, cycles=3)
    code, out, err = run(capsys, path, "--json")
    assert code == 0 and err == ""
    doc = json.loads(out)
    assert doc["valid"] is True and doc["violations"] == [] and doc["warnings"] == []
    s = doc["ranks"]["0"]
    assert s["steps"] == 3
    assert set(s["phases"]) == {"rollout", "engine_release", "trainer_onload", "train",
                                "trainer_offload", "engine_wake_weights", "sync", "engine_wake_kv"}
    assert all(p["count"] == 3 and p["failed"] == 0 for p in s["phases"].values())
    assert s["sync"]["count"] == 3 and s["sync"]["bytes"] == 300  # 10 tensors of 10 B per sync
    peaks = s["peak_memory"]
    assert peaks["staging"]["bytes"] == 84 and peaks["staging"]["phase"] == "sync"
    assert (peaks["trainer.optimizer"]["bytes"], peaks["trainer.optimizer"]["phase"]) == (200, "trainer_onload")
    assert peaks["reserved"]["bytes"] == 0
    used = {"offload-first": (420, "start"),
            # trainer weights + optimizer + engine weights + two 42 B buckets
            "sync-first": (484, "sync"),
            # KV (300) + graphs (20) + weights (100) + two 42 B buckets
            "single-stage": (504, "sync")}[plan]
    assert (peaks["used"]["bytes"], peaks["used"]["phase"]) == used


async def test_text_summary_names_phases_throughput_and_peaks(tmp_path, capsys):
    path = await record(tmp_path / "t.jsonl", cycles=2, reserved=1000)
    code, out, _ = run(capsys, path)
    assert code == 0
    first, *rest = out.splitlines()
    assert first == f"{path}: valid: 98 events, rank 0 of 1, plan offload-first, steps: 2"
    rows = {line.split()[0]: line.split()[1:3] for line in rest[1:9]}
    assert rows["sync"] == ["2", "0"] and rows["rollout"] == ["2", "0"]
    assert any(line.startswith("sync: 2 syncs, 200 B in ") for line in rest)
    peak = {line.split()[0]: line.split()[1:] for line in rest if line.startswith("  ")}
    assert peak["reserved"] == ["1000", "B", "start"]
    assert peak["staging"] == ["84", "B", "sync", "(0)"]


async def test_a_failed_run_is_a_valid_trace_and_its_error_is_summarised(tmp_path, capsys):
    # single-stage on 450 B: the KV cache and two buckets do not fit together
    path = await record(tmp_path / "t.jsonl", plan="single-stage", total=450, fail="oom")
    code, out, _ = run(capsys, path, "--json")
    assert code == 0
    s = json.loads(out)["ranks"]["0"]
    assert s["phases"]["sync"] == {"count": 1, "failed": 1, "seconds": s["phases"]["sync"]["seconds"],
                                   "mean_s": s["phases"]["sync"]["mean_s"]}
    assert s["phases"]["failed"]["count"] == 1
    [err] = s["errors"]
    assert (err["phase"], err["oom_tag"], err["oom_requested"], err["oom_free"]) == ("sync", "staging", 42, 30)


# -- violations ----------------------------------------------------------------------

def _index(events, pred, start=0):
    return next(i for i, e in enumerate(events) if i >= start and pred(e))


def _mutations():
    def drop_kv_resume(ev):
        i = _index(ev, lambda e: e["event"] == "memory.resumed" and e["tag"] == "kv_cache")
        del ev[i]
        j = _index(ev, lambda e: e.get("to_phase") == "rollout", i)
        return j, 1, "rollout refused: engine.kv_cache is not resident"

    def pause_twice(ev):
        i = _index(ev, lambda e: e["event"] == "memory.paused" and e["tag"] == "weights")
        ev.insert(i + 1, dict(ev[i]))
        return i + 1, 4, "engine.weights paused twice (it is already paused)"

    def stages_out_of_order(ev):
        i = _index(ev, lambda e: e["event"] == "bucket.finished" and e["stage"] == "pack")
        ev[i], ev[i + 1] = ev[i + 1], ev[i]
        ev[i]["ts"], ev[i + 1]["ts"] = ev[i + 1]["ts"], ev[i]["ts"]  # time still runs forward
        return i + 1, 6, ("bucket 0: stage pack after handoff (expected the order "
                          "upload < gather < pack < handoff < load, each once)")

    def over_budget(ev):
        i = _index(ev, lambda e: e["event"] == "phase.finished" and e["phase"] == "train")
        ev[i]["mem"]["used"] = 20_000
        return i, 5, "device memory in use 20000 B exceeds the budget 10000 B at phase.finished"

    def skip_sync(ev):
        i = _index(ev, lambda e: e["event"] == "sync.finished")
        del ev[i]
        j = _index(ev, lambda e: e.get("to_phase") == "rollout", i)
        return j, 1, "rollout refused: the engine's weights are stale (expected a complete sync since the last failure)"

    def illegal_transition(ev):
        i = _index(ev, lambda e: e.get("to_phase") == "train")
        ev[i]["to_phase"] = "sync"
        return i, None, "transition trainer_onload -> sync is not in the phase table"

    return [drop_kv_resume, pause_twice, stages_out_of_order, over_budget, skip_sync, illegal_transition]


@pytest.mark.parametrize("mutate", _mutations(), ids=lambda f: f.__name__)
async def test_first_violation_names_its_line_and_what_was_expected(mutate, tmp_path, capsys):
    events = read_trace(await record(tmp_path / "ok.jsonl", cycles=2))
    index, invariant, message = mutate(events)
    bad = write(tmp_path / "bad.jsonl", events)
    code, out, _ = run(capsys, bad)
    assert code == 1
    tag = f"invariant {invariant}: " if invariant else ""
    assert out.splitlines()[0] == f"line {index + 1}: {tag}{message}"
    code, out, _ = run(capsys, bad, "--json")
    doc = json.loads(out)
    assert code == 1 and doc["valid"] is False
    assert doc["violations"][0]["line"] == index + 1
    assert doc["violations"][0]["message"] == message
    assert doc["violations"][0]["invariant"] == invariant
    lines = [v["line"] for v in doc["violations"]]
    assert lines == sorted(lines)


async def test_json_lists_every_violation_each_with_its_line(tmp_path, capsys):
    events = read_trace(await record(tmp_path / "ok.jsonl", cycles=2))
    trains = [i for i, e in enumerate(events) if e["event"] == "phase.finished" and e["phase"] == "train"]
    for i in trains:
        events[i]["mem"]["used"] = 10_001
    code, out, _ = run(capsys, write(tmp_path / "bad.jsonl", events), "--json")
    doc = json.loads(out)
    assert code == 1
    assert [(v["line"], v["invariant"]) for v in doc["violations"]] == [(i + 1, 5) for i in trains]
    code, out, _ = run(capsys, tmp_path / "bad.jsonl")
    assert out.splitlines()[1] == "(1 more violation; --json lists all)"


async def test_events_after_trace_finished_and_an_open_phase_at_the_end_are_violations(tmp_path, capsys):
    events = read_trace(await record(tmp_path / "ok.jsonl", cycles=1))
    fin = events.pop()
    i = _index(events, lambda e: e["event"] == "phase.finished" and e["phase"] == "engine_wake_kv")
    del events[i]
    events.append(fin)
    events.append(dict(fin))
    code, out, _ = run(capsys, write(tmp_path / "bad.jsonl", events), "--json")
    msgs = [(v["line"], v["message"]) for v in json.loads(out)["violations"]]
    n = len(events)
    assert msgs == [
        (n - 1, "trace.finished while phase engine_wake_kv is still open "
                "(expected phase.finished or phase.failed for engine_wake_kv first)"),
        (n, f"trace.finished after trace.finished on line {n - 1} (expected nothing after it)"),
        (n, "trace.finished while phase engine_wake_kv is still open "
            "(expected phase.finished or phase.failed for engine_wake_kv first)"),
    ]


# -- unreadable input ----------------------------------------------------------------

def _unreadable_cases():
    def not_json_in_middle(events):
        lines = [json.dumps(e) for e in events]
        lines[2] = '{"event": "phase.finished", "ts": '
        return "\n".join(lines) + "\n", "line 3: not JSON (Expecting value); expected one colo.trace/1 event per line"

    def garbage_middle_line(events):
        lines = [json.dumps(e) for e in events]
        lines.insert(4, "hello")
        return "\n".join(lines) + "\n", "line 5: not JSON (Expecting value)"

    def wrong_schema(events):
        events[0]["schema"] = "colo.trace/0"
        return events, "line 1: schema 'colo.trace/0'; expected 'colo.trace/1'"

    def missing_schema(events):
        del events[0]["schema"]
        return events, "line 1: trace.started has no schema; expected 'colo.trace/1'"

    def not_a_trace(events):
        return events[1:], "line 1: the first event is 'phase.entered'; expected trace.started"

    def unknown_event(events):
        events[5]["event"] = "phase.exploded"
        # the whole list, from the schema: a new event must not need this test edited
        from colo.core.schema import EVENTS
        return events, f"line 6: unknown event 'phase.exploded'; expected one of {', '.join(sorted(EVENTS))}"

    def unknown_phase(events):
        events[1]["to_phase"] = "warmup"
        return events, "line 2: phase.entered has to_phase 'warmup'; expected one of rollout, engine_release"

    def unknown_phase_finished(events):
        events[3]["phase"] = "decode"
        return events, "line 4: phase.finished has phase 'decode'; expected one of rollout"

    def bad_ts(events):
        events[2]["ts"] = "soon"
        return events, "line 3: rollout.finished has ts 'soon'; expected seconds since trace.started"

    def bad_mem(events):
        events[1]["mem"] = {"used": "a lot"}
        return events, "line 2: phase.entered has a malformed mem"

    def a_list(events):
        lines = [json.dumps(e) for e in events]
        lines[1] = "[1, 2]"
        return "\n".join(lines) + "\n", "line 2: a JSON list; expected one event object per line"

    def other_rank(events):
        events[7]["rank"] = 1
        return events, "is for rank 1 in the trace of rank 0 (expected one file per rank)"

    def empty(events):
        return "", "empty file"

    def blank(events):
        return "\n\n  \n", "empty file"

    def binary(events):
        return b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "binary content"

    def only_a_cut_line(events):
        return json.dumps(events[0])[:40], "no complete line"

    return [not_json_in_middle, garbage_middle_line, wrong_schema, missing_schema, not_a_trace,
            unknown_event, unknown_phase, unknown_phase_finished, bad_ts, bad_mem, a_list, other_rank,
            empty, blank, binary, only_a_cut_line]


@pytest.mark.parametrize("case", _unreadable_cases(), ids=lambda f: f.__name__)
async def test_unreadable_input_exits_2_naming_what_is_wrong(case, tmp_path, capsys):
    events = read_trace(await record(tmp_path / "ok.jsonl", cycles=1))
    content, expected = case(events)
    bad = tmp_path / "bad.jsonl"
    if isinstance(content, bytes):
        bad.write_bytes(content)
    elif isinstance(content, str):
        bad.write_text(content)
    else:
        write(bad, content)
    code, out, err = run(capsys, bad)
    assert code == 2 and out == ""
    assert err.startswith(f"colo replay: {bad}: ") and expected in err
    assert len(err.strip().splitlines()) == 1
    code, out, err = run(capsys, bad, "--json")
    assert code == 2 and json.loads(out)["valid"] is False and expected in json.loads(out)["error"]


def test_a_missing_file_is_bad_input(tmp_path, capsys):
    code, _, err = run(capsys, tmp_path / "nope.jsonl")
    assert code == 2 and "nope.jsonl: cannot read (No such file or directory)" in err


# -- a crash cuts the last line --------------------------------------------------------

async def test_a_cut_last_line_is_dropped_with_a_warning(tmp_path, capsys):
    path = await record(tmp_path / "ok.jsonl", cycles=2)
    text = path.read_text()
    lines = text.splitlines(keepends=True)
    # a crash in the middle of the sync of the second cycle: keep 70 lines and half of the next
    cut = tmp_path / "cut.jsonl"
    cut.write_text("".join(lines[:70]) + lines[70][: len(lines[70]) // 2])
    code, out, err = run(capsys, cut, "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["valid"] is True and doc["files"][0]["events"] == 70 and doc["files"][0]["truncated"] is True
    assert doc["warnings"] == [f"{cut}: line 71 is cut off (the run stopped mid-write); "
                               "replayed the 70 complete lines before it"]
    assert f"warning: {cut}: line 71 is cut off" in err
    # cut inside a multi-byte character: still a cut line, not binary input
    cut.write_bytes("".join(lines[:70]).encode() + '{"event":"rollout.finished","note":"é'.encode()[:-1])
    assert run(capsys, cut)[0] == 0


async def test_a_complete_last_line_without_newline_is_kept_and_a_missing_end_is_warned(tmp_path, capsys):
    path = await record(tmp_path / "ok.jsonl", cycles=1)
    lines = path.read_text().splitlines()
    short = tmp_path / "short.jsonl"
    short.write_text("\n".join(lines[:30]))  # no newline after line 30, but it is whole
    trace = load_trace(short)
    assert len(trace.events) == 30 and not trace.truncated
    assert trace.warnings == [f"{short}: no trace.finished (the run did not end cleanly, or is still running)"]


async def test_a_cut_trace_whose_prefix_is_invalid_exits_1(tmp_path, capsys):
    events = read_trace(await record(tmp_path / "ok.jsonl", cycles=1))
    events[3]["mem"]["used"] = 99_999
    bad = write(tmp_path / "bad.jsonl", events[:10], tail='{"event":"memory.pa')
    code, out, _ = run(capsys, bad)
    assert code == 1 and out.startswith("line 4: invariant 5: device memory in use 99999 B")


# -- several ranks -------------------------------------------------------------------

async def _two_ranks(tmp_path, plans=("offload-first", "offload-first"), cycles=(2, 2)):
    return [await record(tmp_path / f"run.rank{r}.jsonl", plan=plans[r], cycles=cycles[r], rank=r,
                         world_size=2, run_id="two-ranks") for r in (0, 1)]


async def test_ranks_that_agree_replay_together(tmp_path, capsys):
    a, b = await _two_ranks(tmp_path)
    code, out, _ = run(capsys, b, a)
    assert code == 0
    assert out.splitlines()[-1] == "ranks 1, 0 moved through the same phases in the same order (16 phases on rank 1)"
    code, out, _ = run(capsys, a, b, "--json")
    doc = json.loads(out)
    assert sorted(doc["ranks"]) == ["0", "1"] and [f["rank"] for f in doc["files"]] == [0, 1]


async def test_ranks_taking_different_orders_are_a_violation(tmp_path, capsys):
    a, b = await _two_ranks(tmp_path, plans=("offload-first", "sync-first"))
    code, out, _ = run(capsys, a, b)
    events = read_trace(b)
    line = 1 + _index(events, lambda e: e.get("to_phase") == "engine_wake_weights")
    ref = 1 + _index(read_trace(a), lambda e: e.get("to_phase") == "trainer_offload")
    assert code == 1
    assert out.splitlines()[0] == (
        f"{b}: line {line}: rank 1 entered engine_wake_weights as its phase #5 but rank 0 entered "
        f"trainer_offload ({a} line {ref}); expected the same phases in the same order")


async def test_a_rank_that_stops_early_is_a_violation_unless_its_trace_was_cut(tmp_path, capsys):
    a, b = await _two_ranks(tmp_path, cycles=(2, 1))
    code, out, _ = run(capsys, a, b)
    assert code == 1
    assert f"rank 1 stops after 8 phases but rank 0 goes on to rollout ({a} line " in out
    lines = b.read_text().splitlines(keepends=True)
    b.write_text("".join(lines[:-1]) + lines[-1][:10])  # trace.finished cut by a crash
    code, out, err = run(capsys, a, b)
    assert code == 0 and "its trace ends early, so only the common prefix was compared" in err


async def test_two_files_for_one_rank_or_different_world_sizes_are_bad_input(tmp_path, capsys):
    a, _ = await _two_ranks(tmp_path)
    code, _, err = run(capsys, a, a)
    assert code == 2 and "are both rank 0; expected one file per rank" in err
    single = await record(tmp_path / "single.jsonl", rank=0, world_size=1)
    other = await record(tmp_path / "other.rank1.jsonl", rank=1, world_size=3)
    code, _, err = run(capsys, single, other)
    assert code == 2 and "the files disagree on world_size" in err


async def _run_of_two_ranks(tmp_path, name):
    """One run of two ranks, as the multi-rank demo makes it: one scheduler, a trace per rank."""
    paths = [tmp_path / f"{name}.rank{r}.jsonl" for r in (0, 1)]
    # sizes in KiB: colo tune, which takes these ranks too, recommends no bucket under 16 KiB
    k = 1024
    s = Scheduler([FakeTrainer(weights=100 * k, optimizer=200 * k) for _ in paths],
                  [FakeEngine(weights=100 * k, kv_cache=300 * k, cuda_graph=20 * k) for _ in paths],
                  [MemoryLedger(total_bytes=10_000 * k) for _ in paths], [FakeTransport(), FakeTransport()],
                  trace=[TraceWriter(p, rank=r, world_size=2) for r, p in enumerate(paths)],
                  config=SchedulerConfig(bucket_bytes=50 * k))
    async with s:
        await s.cycle()
    return s.run_id, paths


async def test_ranks_of_two_runs_are_bad_input_naming_both_runs(tmp_path, capsys):
    """Issue 32, item 7: rank 0 of one run and rank 1 of another replayed as one valid run."""
    (run_a, (a0, a1)), (run_b, (b0, b1)) = [await _run_of_two_ranks(tmp_path, n) for n in "ab"]
    assert run_a != run_b and len(run_a) == 32
    assert [read_trace(p)[0]["run_id"] for p in (a0, a1, b0, b1)] == [run_a, run_a, run_b, run_b]
    for pair in ((a0, a1), (b1, b0)):
        assert run(capsys, *pair)[0] == 0
    code, out, err = run(capsys, a0, b1)
    assert code == 2 and out == "" and "Traceback" not in err
    assert err.strip() == (f"colo replay: {a0} (rank 0) is of run {run_a} but {b1} (rank 1) is of run {run_b}; "
                           "expected the ranks of one run")
    code, out, _ = run(capsys, a0, b1, "--json")
    assert code == 2 and json.loads(out)["valid"] is False


async def test_traces_written_before_run_ids_still_replay_but_not_beside_a_run_with_one(tmp_path, capsys):
    _, (a0, a1) = await _run_of_two_ranks(tmp_path, "a")
    _, (b0, b1) = await _run_of_two_ranks(tmp_path, "b")
    for p in (a0, a1, b0):  # as an older colo wrote them: no run_id in trace.started
        events = read_trace(p)
        del events[0]["run_id"]
        write(p, events)
    assert run(capsys, a0)[0] == 0 and run(capsys, a0, a1)[0] == 0
    code, _, err = run(capsys, a0, b1)
    assert code == 2 and f"{a0} (rank 0) is of no run id (an older colo wrote it) but {b1} (rank 1) is of run " in err


@pytest.mark.parametrize("value", ["", "x" * 129, "tab\t", "é", 7, None, ["a"]])
async def test_a_run_id_that_is_not_a_short_printable_string_is_bad_input(value, tmp_path, capsys):
    events = read_trace(await record(tmp_path / "t.jsonl"))
    events[0]["run_id"] = value
    p = write(tmp_path / "t.jsonl", events)
    code, _, err = run(capsys, p)
    if value is None:  # null: as if absent
        assert code == 0
    else:
        assert code == 2 and "trace.started has run_id" in err and "printable ASCII" in err


async def test_a_missing_rank_is_a_warning(tmp_path, capsys):
    paths = [await record(tmp_path / f"r{r}.jsonl", rank=r, world_size=3, cycles=1, run_id="three") for r in (0, 2)]
    code, _, err = run(capsys, *paths)
    assert code == 0 and "warning: ranks 1 of world_size 3 were not given" in err


# -- robustness and purity -------------------------------------------------------------

@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
async def test_any_single_line_edit_gives_a_verdict_never_a_crash(data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("h")
    events = read_trace(await record(tmp / "ok.jsonl", cycles=1))
    i = data.draw(st.integers(1, len(events) - 1))
    op = data.draw(st.sampled_from(["drop", "dup", "swap"]))
    if op == "drop":
        del events[i]
    elif op == "dup":
        events.insert(i, dict(events[i]))
    elif i + 1 < len(events):
        events[i], events[i + 1] = events[i + 1], events[i]
    try:
        report = replay([write(tmp / "m.jsonl", events)])
    except BadTrace:
        return
    assert all(f.line is not None and 1 <= f.line <= len(events) for f in report.findings)


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-2, 10**30) | st.floats(allow_nan=False)
                     | st.sampled_from(["", "sync", "engine", "kv_cache", "x"]),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
                     max_leaves=4)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
async def test_any_field_set_to_any_json_value_is_bad_input_or_a_verdict(data, tmp_path_factory):
    from colo.offline.export import export
    from colo.offline.tune import TuneError, tune

    tmp = tmp_path_factory.mktemp("f")
    events = read_trace(await record(tmp / "ok.jsonl", cycles=1))
    target = events[data.draw(st.integers(0, len(events) - 1))]
    while True:  # walk down into a nested object now and then
        key = data.draw(st.sampled_from(sorted(target)))
        if isinstance(target[key], dict) and target[key] and data.draw(st.booleans()):
            target = target[key]
            continue
        break
    target[key] = data.draw(_JSON)
    path = write(tmp / "m.jsonl", events)
    try:
        trace = load_trace(path)
    except BadTrace:
        return
    replay([path])
    export([trace])
    try:
        tune([trace])
    except TuneError:
        pass


def test_replay_export_tune_and_summary_import_no_torch_anyio_or_structlog():
    modules = ["colo.offline.replay", "colo.offline.summary", "colo.offline.export", "colo.offline.tune"]
    forbidden = ["torch", "anyio", "structlog", "torch_memory_saver"]
    code = (f"import sys; import {', '.join(modules)}; "
            f"print(','.join(m for m in {forbidden!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_empty_argument_list_is_bad_input():
    with pytest.raises(BadTrace, match="no trace given"):
        replay([])


# -- the committed traces --------------------------------------------------------------

TRACES = sorted((__import__("pathlib").Path(__file__).resolve().parents[2] / "traces").glob("*.jsonl"))


#: committed traces that record a failure on purpose: (phase, error type) of their one failure.
#: colo tune's GPU round trip above the recommendation (issue 17) must fail, cleanly, right there.
EXPECTED_FAILURES = {"gpu-tune-above.jsonl": ("engine_wake_kv", "OutOfMemory")}


@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.name)
def test_committed_traces_replay_clean(path, capsys):
    code, out, err = run(capsys, path, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["valid"] is True and doc["warnings"] == [] and err == ""
    assert doc["files"][0]["finished"] is True
    summary = doc["ranks"][str(doc["files"][0]["rank"])]
    assert summary["sync"]["count"] >= 1
    failures = [(e["phase"], e["error_type"]) for e in summary["errors"]]
    assert failures == ([EXPECTED_FAILURES[path.name]] if path.name in EXPECTED_FAILURES else [])
