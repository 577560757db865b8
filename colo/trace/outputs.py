"""Where colo writes on a user's behalf: a new path or an existing regular file, nothing else.

A trace, an export, a benchmark result: each is written to a path the user
named (or one derived from it, ``run.rank1.jsonl``). Writing a result into a
temporary file and renaming it over the path replaces *whatever* was there; as
root that turned a character device (/dev/full) into a JSON file of mode 0666,
and would have turned the system's /dev/stdout symlink into one. So every such
path is checked first, with ``lstat``:

- it does not exist: the file is made there;
- it is a regular file: it is replaced (or truncated), as asked;
- it is a symbolic link the user named: followed to the regular file it names
  (the link stays, the file it names gets the result); a link to anything else,
  or to nothing, is refused; so is a link through an open descriptor
  (``/dev/stdout`` -> ``/proc/self/fd/1``): the file it resolves to would be replaced
  by a new one while the descriptor still writes into the old, so the process's own
  output (colo's status line, a redirect's target) is lost;
- anything else (a device, a FIFO, a socket, a directory) is refused, untouched.

A path colo derives itself (a rank's trace beside the one named) is never opened
through a symbolic link: nobody asked for that link.
"""

from __future__ import annotations

import os
import re
import stat

from colo.core.errors import UsageError

EXPECTED = "expected a new path or an existing regular file"


def kind_of(mode: int) -> str:
    """What a file mode says the file is, as a user reads it."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISLNK, "a symbolic link"), (stat.S_ISREG, "a regular file")):
        if test(mode):
            return name
    return "not a regular file"


def output_path(path: str | os.PathLike, flag: str, *, follow: bool = True) -> str:
    """The path to write for ``path`` (given as ``flag``, which the refusal names): ``path``
    itself when it is new or a regular file, the regular file a symbolic link names when
    ``follow`` (a path the user named). Raises :class:`UsageError` (exit 2) for anything else,
    having touched nothing."""
    p = os.fspath(path)
    if not p:
        raise UsageError(f"{flag} is empty; {EXPECTED}")
    try:
        st = os.lstat(p)
    except OSError:
        # nothing there, or nothing reachable (a parent that is a file, no permission):
        # nothing to replace either; the writer says why it cannot make the file
        return p
    if stat.S_ISREG(st.st_mode):
        return p
    if stat.S_ISLNK(st.st_mode):
        hop = _descriptor_hop(p)
        if hop is not None:
            raise UsageError(f"{flag} {p} is a link to an open descriptor ({hop}); colo writes its result to a "
                             f"new file and renames it into place, which a descriptor would not see: "
                             f"{EXPECTED}, and it was left as it was")
        if not follow:
            raise UsageError(f"{flag} {p} is a symbolic link colo did not ask for (it derives this path from "
                             f"the one given, and opens nothing through a link); {EXPECTED}")
        real = os.path.realpath(p)
        try:
            target = os.stat(real)
        except OSError:
            raise UsageError(f"{flag} {p} is a symbolic link to {real}, which does not exist; {EXPECTED}") \
                from None
        if not stat.S_ISREG(target.st_mode):
            raise UsageError(f"{flag} {p} is a symbolic link to {kind_of(target.st_mode)} ({real}), not a "
                             f"regular file; {EXPECTED}, and it was left as it was")
        return real
    raise UsageError(f"{flag} {p} is not a regular file ({kind_of(st.st_mode)}); {EXPECTED}, "
                     "and it was left as it was")


#: a process's descriptors under /proc: a "magic" link that resolves to whatever the descriptor has open
_FD_LINK = re.compile(r"^/proc/[^/]+/fd/[0-9]+$")


def _descriptor_hop(path: str, hops: int = 40) -> str | None:
    """The ``/proc/<pid>/fd/<n>`` a chain of symbolic links from ``path`` passes through, if any
    (``path`` itself included)."""
    cur = os.path.abspath(path)
    for _ in range(hops):
        # the directories resolved, the last component not: /dev/fd/1 is /proc/<pid>/fd/1
        cur = os.path.join(os.path.realpath(os.path.dirname(cur)), os.path.basename(cur))
        if _FD_LINK.match(cur):
            return cur
        try:
            nxt = os.readlink(cur)
        except OSError:
            return None  # not a link (any more): the chain ended
        cur = os.path.normpath(os.path.join(os.path.dirname(cur), nxt))
    return None


def replace_into(tmp: str, target: str, flag: str) -> None:
    """Rename the finished ``tmp`` over ``target``, checked again just before: a node that
    appeared there since :func:`output_path` is refused rather than replaced."""
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISREG(st.st_mode):
            raise UsageError(f"{flag} {target} became {kind_of(st.st_mode)} while colo was writing; "
                             f"{EXPECTED}, and it was left as it was")
    os.replace(tmp, target)


__all__ = ["EXPECTED", "kind_of", "output_path", "replace_into"]
