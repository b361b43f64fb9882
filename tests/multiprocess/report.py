"""What the scripts here tell the tests: one JSON object a line.

report(kind, **fields) prints `JAXRING_REPORT {"kind": kind, ...}` on a line
of its own and flushes it, so that a test finds it among everything else the
process prints (under jaxring.launch, behind the `[rank] ` prefix of its
process) and reads it with json.loads (tests/reports.py). The fields are
plain values: ints, floats, bools, None, strings, and lists and dicts of
them. The scripts are run as files, their own directory first on sys.path
(as python and the launcher both put it), so they import this as `report`.
"""

import json
import sys

MARKER = "JAXRING_REPORT"


def report(kind: str, **fields) -> None:
    line = json.dumps({"kind": kind, **fields}, sort_keys=True)
    # One write of the whole line: another thread's output cannot land in it.
    sys.stdout.write(f"{MARKER} {line}\n")
    sys.stdout.flush()
