"""Issue 16, reliability round 2: traces and flags that are not what they claim
(items 8 and 5): refused with exit 2 naming the line or the flag, never a
traceback, a hang, or a file of non-JSON; export never destroys what it replaces."""

import json
import os
import threading

import pytest

from colo.cli import main
from colo.offline import export as export_mod
from tests.nodes import KINDS, identity as _identity, make_node as _node

HEAD = {"event": "trace.started", "schema": "colo.trace/1", "ts": 0.0, "rank": 0, "world_size": 1,
        "device": {"kind": "cpu", "name": "x", "total_bytes": 1 << 30}, "config": {}}
MEM = {"used": 0, "total": 1 << 30, "by_tag": {}}
ENTER = {"event": "phase.entered", "ts": 0.1, "rank": 0, "step": 0, "from_phase": None,
         "to_phase": "engine_release", "mem": MEM}
DONE = {"event": "phase.finished", "ts": 0.2, "rank": 0, "step": 0, "phase": "engine_release",
        "duration_s": 0.1, "mem": MEM}
END = {"event": "trace.finished", "ts": 0.3, "rank": 0}


def _line(ev, **raw):
    """``ev`` as a JSON line, with ``raw`` values spliced in as written (NaN, 10**400...)."""
    text = json.dumps({**ev, **{k: "@" + k for k in raw}})
    for k, v in raw.items():
        text = text.replace(json.dumps("@" + k), v)
    return text + "\n"


def _write(path, lines):
    path.write_text("".join(x if isinstance(x, str) else json.dumps(x) + "\n" for x in lines))
    return path


# -- item 8: non-finite, mistyped, huge and deep values --------------------------------

BAD = {
    "nan ts": ([HEAD, _line(ENTER, ts="NaN"), DONE, END], 2, "NaN is not a JSON number"),
    "infinite duration": ([HEAD, ENTER, _line(DONE, duration_s="Infinity"), END], 3, "Infinity is not a JSON number"),
    "1e400 duration": ([HEAD, ENTER, _line(DONE, duration_s="1e400"), END], 3, "the number 1e400 is out of range"),
    "string step": ([HEAD, {**ENTER, "step": "3"}, DONE, END], 2, "phase.entered has step '3'; expected an integer >= 0"),
    "bool step": ([HEAD, {**ENTER, "step": True}, DONE, END], 2, "phase.entered has step True"),
    "10**400 bytes": ([HEAD, ENTER, _line(DONE, mem='{"used": 1%s, "total": 1, "by_tag": {}}' % ("0" * 400)), END],
                      3, "a number of 401 digits; expected at most 20"),
    "5000 digits in config": ([_line(HEAD, config='{"seed": %s}' % ("9" * 5000)), END], 1, "a number of 5000 digits"),
    "100k deep": ([HEAD, _line(ENTER, note="[" * 100_000 + "]" * 100_000), DONE, END], 2, "nested deeper than 64 levels"),
    "ts past export's range": ([HEAD, {**ENTER, "ts": 1e303}, DONE, END], 2, "phase.entered has ts 1e+303"),
    "negative tag bytes": ([HEAD, ENTER, {**DONE, "mem": {**MEM, "by_tag": {"engine.weights": -5}}}, END],
                           3, "phase.finished has a malformed mem"),
    "string weight_version": ([HEAD, {"event": "sync.finished", "ts": 0.1, "rank": 0, "step": 0, "bytes": 0,
                                      "buckets": 0, "duration_s": 0.0, "weight_version": "1"}, END],
                              2, "sync.finished has weight_version '1'; expected an integer"),
    "string reward": ([HEAD, {"event": "rollout.finished", "ts": 0.1, "rank": 0, "step": 0, "reward": "high"}, END],
                      2, "rollout.finished has reward 'high'; expected a number"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_a_trace_with_non_finite_mistyped_huge_or_deep_values_exits_two_naming_the_line(name, tmp_path, capsys):
    lines, line_no, said = BAD[name]
    p = _write(tmp_path / "t.jsonl", lines)
    before = p.read_bytes()
    out = tmp_path / "t.json"
    out.write_text("previous")
    assert main(["replay", str(p)]) == 2
    err = capsys.readouterr().err
    assert f"{p}: line {line_no}: " in err and said in err and "Traceback" not in err
    assert main(["replay", "--json", str(p)]) == 2
    doc = json.loads(capsys.readouterr().out)
    assert doc["valid"] is False and f"line {line_no}: " in doc["error"] and said in doc["error"]
    # before: export read it as valid and wrote Infinity/NaN, or died in float()
    assert main(["export", str(p), "-o", str(out)]) == 2
    assert said in capsys.readouterr().err
    assert out.read_text() == "previous" and p.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["t.json", "t.jsonl"]  # no temporary file left behind


def test_two_ranks_claiming_a_trillion_ranks_are_refused(tmp_path, capsys):
    files = []
    for rank in (0, 1):
        h = {**HEAD, "rank": rank, "world_size": 10**12}
        files.append(_write(tmp_path / f"r{rank}.jsonl", [h, {**END, "rank": rank}]))
    # before: the missing-ranks warning built a set of 10**12 ranks
    assert main(["replay", *map(str, files)]) == 2
    err = capsys.readouterr().err
    assert f"{files[0]}: line 1: trace.started has world_size 1000000000000; expected an integer in [1, 1048576]" in err


def test_many_missing_ranks_are_counted_not_listed(tmp_path, capsys):
    files = [_write(tmp_path / f"r{r}.jsonl", [{**HEAD, "rank": r, "world_size": 1 << 20}, {**END, "rank": r}])
             for r in (0, 5)]
    assert main(["replay", *map(str, files)]) == 0
    err = capsys.readouterr().err
    assert "ranks 1, 2, 3, 4, 6, 7, 8, 9 and 1048566 more of world_size 1048576 were not given" in err


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_fifo_or_a_directory_as_a_trace_is_refused_without_blocking(kind, tmp_path, capsys):
    p = tmp_path / "t.jsonl"
    if kind == "fifo":
        os.mkfifo(p)
    else:
        p.mkdir()
    done = threading.Event()

    def unblock():  # before the fix, open() on a FIFO without a writer blocks: end that after 10 s
        if done.wait(10) or kind != "fifo":
            return
        while not done.wait(0.2):
            try:
                os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:  # no reader yet
                pass

    watchdog = threading.Thread(target=unblock, daemon=True)
    watchdog.start()
    try:
        rc_replay = main(["replay", str(p)])
        err_replay = capsys.readouterr().err
        rc_export = main(["export", str(p), "-o", str(tmp_path / "out.json")])
        err_export = capsys.readouterr().err
    finally:
        done.set()
        watchdog.join()
    what = "a FIFO" if kind == "fifo" else "a directory"
    assert rc_replay == 2 and f"{p}: {what}, not a regular file" in err_replay
    assert rc_export == 2 and f"{p}: {what}, not a regular file" in err_export
    assert not (tmp_path / "out.json").exists()


# -- item 5: export onto its own input; a failed export keeps the old output -------------

@pytest.mark.parametrize("spelling", ["same", "dotted", "symlink"])
def test_export_onto_its_own_trace_is_refused_and_the_trace_is_untouched(spelling, tmp_path, capsys):
    p = _write(tmp_path / "t.jsonl", [HEAD, ENTER, DONE, END])
    before = p.read_bytes()
    out = {"same": str(p), "dotted": str(tmp_path / "." / "t.jsonl"), "symlink": str(tmp_path / "link.jsonl")}[spelling]
    if spelling == "symlink":
        os.symlink(p, out)
    assert main(["export", str(p), "-o", out]) == 2
    assert "is the input trace" in capsys.readouterr().err
    assert p.read_bytes() == before


def test_an_export_that_fails_while_writing_leaves_the_previous_output(tmp_path, capsys, monkeypatch):
    p = _write(tmp_path / "t.jsonl", [HEAD, ENTER, DONE, END])
    out = tmp_path / "t.json"
    assert main(["export", str(p), "-o", str(out)]) == 0
    good = out.read_text()
    json.loads(good, parse_constant=lambda c: pytest.fail(f"export wrote {c}"))
    # a value JSON cannot hold, reaching the writer (say, from a future exporter bug)
    real = export_mod.export
    monkeypatch.setattr(export_mod, "export", lambda traces: {**real(traces), "otherData": {"rate": float("inf")}})
    capsys.readouterr()
    assert main(["export", str(p), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "Out of range float values are not JSON compliant" in err and f"{out} was left as it was" in err
    assert out.read_text() == good
    assert sorted(os.listdir(tmp_path)) == ["t.json", "t.jsonl"]


# -- item 5: number flags -------------------------------------------------------------

@pytest.mark.parametrize("argv,said", [
    (["tune", "--gpu-gib", "inf", "--model-gib", "15"], "argument --gpu-gib: expected a positive float of at most 1048576, got inf"),
    (["tune", "--gpu-gib", "1e308", "--model-gib", "15"], "argument --gpu-gib: expected a positive float of at most 1048576, got 1e308"),
    (["tune", "--gpu-gib", "80", "--model-gib", "1e309"], "argument --model-gib: expected a positive float of at most 1048576, got 1e309"),
    (["tune", "--gpu-gib", "80", "--model-gib", "15", "--bucket-mib", "1e308"], "argument --bucket-mib: expected a positive float of at most 1048576"),
    (["tune", "--gpu-gib", "80", "--model-gib", "15", "--margin-gib", "inf"], "argument --margin-gib: expected a number in [-1048576, 1048576], got inf"),
    (["tune", "--gpu-gib", "80", "--model-gib", "15", "--margin-gib=-1e308"], "argument --margin-gib: expected a number in [-1048576, 1048576]"),
    (["demo", "--bucket-mib", "inf"], "argument --bucket-mib: expected a positive float of at most 1048576, got inf"),
    (["demo", "--device-mem-gib", "1e308"], "argument --device-mem-gib: expected a positive float of at most 1048576"),
    (["demo", "--device-mem-gib", "inf"], "argument --device-mem-gib: expected a positive float of at most 1048576, got inf"),
    (["demo", "--steps", "1" + "0" * 30], "argument --steps: expected a positive int of at most 1000000"),
    (["demo", "--seed", "1" + "0" * 30], "argument --seed: expected a number in [0, 4294967295]"),
])
def test_non_finite_or_absurd_numbers_in_flags_exit_two_naming_the_flag(argv, said, tmp_path, capsys, monkeypatch):
    trace = tmp_path / "t.jsonl"
    trace.write_text("keep\n")
    if argv[0] == "demo":
        argv = [*argv, "--quiet", "--trace", str(trace)]
        # refused while parsing, so the demo never starts (before: it started, with 10**30 steps)
        monkeypatch.setattr("colo.apps.demo.run_demo", lambda args: pytest.fail("the demo ran"))
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own exit
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err
    assert trace.read_text() == "keep\n"


# -- issue 32, item 1: an output goes only to a new path or a regular file -----------------

@pytest.mark.parametrize("kind", KINDS)
def test_export_onto_anything_but_a_new_path_or_a_regular_file_exits_two_and_leaves_it_as_it_was(kind, tmp_path,
                                                                                                capsys):
    p = _write(tmp_path / "t.jsonl", [HEAD, ENTER, DONE, END])
    out = tmp_path / "out.json"
    _node(out, kind, tmp_path)
    before, names = _identity(out), sorted(os.listdir(tmp_path))
    assert main(["export", str(p), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"-o {out}" in err and "expected a new path or an existing regular file" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert _identity(out) == before  # the node itself, not a regular file put in its place
    assert sorted(os.listdir(tmp_path)) == names  # no temporary file left beside it


def test_export_through_a_symlink_the_user_named_replaces_the_regular_file_it_names_and_keeps_the_link(tmp_path,
                                                                                                      capsys):
    p = _write(tmp_path / "t.jsonl", [HEAD, ENTER, DONE, END])
    target = tmp_path / "runs" / "t.json"
    target.parent.mkdir()
    target.write_text("old\n")
    link = tmp_path / "latest.json"
    os.symlink(target, link)
    assert main(["export", str(p), "-o", str(link)]) == 0
    assert os.path.islink(link) and os.readlink(link) == str(target)
    assert "traceEvents" in json.loads(target.read_text())
