"""Reading what a test's subprocess reports: JSON objects, one a line.

The scripts the tests run report with report(kind, **fields)
(tests/multiprocess/report.py), which prints `JAXRING_REPORT {...}`; under
jaxring.launch each line carries its process's `[rank] ` prefix in front.
A script the test gives as text starts with REPORT_SOURCE, the same helper.
A line that carries the marker anywhere but is not such a report fails the
test: no report is skipped.
"""

import collections
import json
import re
import runpy
from collections.abc import Iterable
from pathlib import Path

import pytest

_REPORT_PY = Path(__file__).parent / "multiprocess" / "report.py"
MARKER = runpy.run_path(str(_REPORT_PY))["MARKER"]
# Put first in a script given as text (python -c, a file the test writes):
# it defines report() as the scripts under tests/multiprocess/ import it.
REPORT_SOURCE = _REPORT_PY.read_text()

_PREFIXED = re.compile(r"\[(\d+)\] (.*)", re.ASCII | re.DOTALL)


def parse(line: str) -> dict | None:
    """The report on one line of output (without a launcher's prefix), or
    None where the line has no marker."""
    if MARKER not in line:
        return None
    if not line.startswith(MARKER + " "):
        pytest.fail(f"a line carries {MARKER} but does not start with it: {line!r}")
    try:
        fields = json.loads(line[len(MARKER) + 1 :])
    except json.JSONDecodeError as e:
        pytest.fail(f"a {MARKER} line that is not JSON ({e}): {line!r}")
    if not isinstance(fields, dict) or not isinstance(fields.get("kind"), str):
        pytest.fail(f"a {MARKER} line that is not an object with a kind: {line!r}")
    return fields


def reports(output: str | Iterable[str]) -> list[dict]:
    """The reports of one process, in order: its output as one string, or
    as lines (a Job's)."""
    lines = output.splitlines() if isinstance(output, str) else output
    return [r for r in map(parse, lines) if r is not None]


def output_by_rank(stdout: str) -> dict[int, list[dict | str]]:
    """Every line each process of a jaxring.launch job printed, in order, by
    the rank its lines are prefixed with: a report as its dict, any other
    line as its text (for a check on all a process printed)."""
    out = collections.defaultdict(list)
    for line in stdout.splitlines():
        prefixed = _PREFIXED.fullmatch(line)
        if prefixed:
            text = prefixed.group(2)
            report = parse(text)
            out[int(prefixed.group(1))].append(text if report is None else report)
        elif MARKER in line:
            pytest.fail(f"a {MARKER} line without a [rank] prefix: {line!r}")
    return out


def reports_by_rank(stdout: str) -> dict[int, list[dict]]:
    """The reports of each process of a jaxring.launch job, in order, by
    rank: every rank that printed a line has an entry (empty where none of
    its lines was a report); any other rank, an empty list."""
    return collections.defaultdict(
        list,
        {
            rank: [line for line in lines if isinstance(line, dict)]
            for rank, lines in output_by_rank(stdout).items()
        },
    )


def of_kind(said: list, kind: str) -> list[dict]:
    """The reports of one kind, in order (in reports, or in a process's
    output_by_rank)."""
    return [r for r in said if isinstance(r, dict) and r["kind"] == kind]


def one(said: list, kind: str) -> dict:
    """The one report of a kind; fails if there are none or several."""
    found = of_kind(said, kind)
    assert len(found) == 1, f"{len(found)} reports of kind {kind!r}; the last lines: {said[-5:]}"
    return found[0]
