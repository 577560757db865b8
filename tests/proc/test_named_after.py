"""tests.leaks.named_after: what a test finds in /dev/shm and /tmp named after processes it
signalled. A UUID-named entry is never one, though its hex groups may read as a pid (a
fresh-clone CI run's vLLM test matched ``/tmp/ad70f22d-d986-4594-...`` against pid 4594)."""

import os
import uuid

from tests.leaks import named_after


def test_an_entry_named_after_a_pid_is_found_and_a_uuid_that_reads_as_one_is_not(tmp_path):
    # a number above any pid_max (2**22 on Linux): no process of another test is named so
    pid = 2**31 - 1
    name = f"colo_test_{pid}_{os.getpid()}"
    # a UUID one of whose hex groups reads as a pid: 4594, as in that CI run
    fake_uuid = str(uuid.UUID(f"ad70f22d-d986-4594-9ca1-{uuid.uuid4().hex[:12]}"))
    made = [f"/tmp/{name}", f"/tmp/{fake_uuid}"]
    for path in made:
        open(path, "w").close()
    try:
        assert f"/tmp/{name}" in named_after([pid]) and f"/tmp/{name}" not in named_after([pid - 1])
        assert f"/tmp/{fake_uuid}" not in named_after([4594])
    finally:
        for path in made:
            os.unlink(path)
