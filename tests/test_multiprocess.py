"""Several processes (jax.distributed) with jaxring's TCP transport.

Each test starts real processes, through `python -m jaxring.launch` or, where
the test kills one, directly with the launcher's environment. The scripts
they run live in tests/multiprocess/ and compare against numpy in the same
run. Coordinator ports come from the OS, so parallel runs cannot collide.
"""

import collections
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from reports import REPORT_SOURCE, of_kind, one, output_by_rank, reports, reports_by_rank

from jaxring import launch

SCRIPTS = Path(__file__).parent / "multiprocess"

pytestmark = pytest.mark.multiprocess


def run_launcher(
    nproc: int,
    script: str,
    *args,
    devices_per_process: int = 1,
    timeout: float = 240,
    env: dict | None = None,
) -> subprocess.CompletedProcess:
    # Outside the checkout, so the installed package is imported.
    with tempfile.TemporaryDirectory() as cwd:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "jaxring.launch",
                "-n",
                str(nproc),
                "--devices-per-process",
                str(devices_per_process),
                str(SCRIPTS / script),
                *map(str, args),
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=cwd,
            env=None if env is None else {**os.environ, **env},
        )


def lines_by_rank(stdout: str) -> dict[int, list[str]]:
    """The plain lines each process printed (the scripts here report with
    JSON: tests/reports.py reads them)."""
    out = collections.defaultdict(list)
    for line in stdout.splitlines():
        if line.startswith("[") and "] " in line:
            rank, text = line[1:].split("] ", 1)
            if rank.isdigit():
                out[int(rank)].append(text)
    return out


def same_checks(by_rank: dict[int, list[dict]]) -> list[dict]:
    """The "check" reports of allreduce_check.py (a digest of the bits per
    case), the same in every process."""
    checks = {json.dumps(of_kind(said, "check"), sort_keys=True) for said in by_rank.values()}
    assert len(checks) == 1, checks  # every process got the same bits
    return json.loads(checks.pop())


# The older supported jax releases run one case of each kind (flat, tiered,
# exchange, one fault of each sort, ...); the others differ only in the
# plan, the links, the launcher or the fault, which are jaxring's own code
# whatever the jax, and run on the newest jax only.
newest_jax_only = pytest.mark.jax_independent

# (processes, devices per process, seed, topology setting, tiers lowered,
# JAXRING_TRANSPORT)
ACROSS_PROCESSES = [
    # On one host auto runs direct over the host segment at every size,
    # with one device per process or several.
    pytest.param(2, 1, 0, "auto", "flat", "auto", id="2-processes"),
    # The flat ring across processes, as auto runs it beyond one host.
    pytest.param(2, 1, 11, "ring", "flat", "auto", id="2-processes-ring", marks=newest_jax_only),
    pytest.param(4, 1, 1, "auto", "flat", "auto", id="4-processes", marks=newest_jax_only),
    # topology="flat": one ring over every rank.
    pytest.param(2, 2, 2, "flat", "flat", "auto", id="2x2-flat", marks=newest_jax_only),
    pytest.param(2, 2, 3, "auto", "flat", "auto", id="2x2-auto"),
    pytest.param(4, 2, 13, "auto", "flat", "auto", id="4x2-auto", marks=newest_jax_only),
    # Without the host segment (as on several hosts), "auto" runs the
    # tiered ring it derives, and the exchange for small operands.
    pytest.param(2, 2, 14, "auto", "2x2", "tcp", id="2x2-tiered-auto-tcp", marks=newest_jax_only),
    # The ring with the tiers "auto" derives: the devices of a process,
    # then the processes of the host.
    pytest.param(2, 2, 12, "ring", "2x2", "auto", id="2x2-tiered-ring"),
    pytest.param(4, 2, 4, "ring", "2x4", "auto", id="4x2-tiered-ring", marks=newest_jax_only),
    # Explicit tiers: across processes only, and two tiers inside each.
    pytest.param(4, 1, 5, "2x2", "2x2", "auto", id="4-processes-tiered-2x2", marks=newest_jax_only),
    pytest.param(2, 4, 6, "2x2x2", "2x2x2", "auto", id="2x4-tiered-2x2x2", marks=newest_jax_only),
    # Recursive doubling: 3 processes (a ring over the odd factor), 2
    # processes of 2 devices (one exchange in memory, one across), and 4 of
    # 2 (two exchanges across in a row: the second must not overwrite what
    # the first still sends).
    pytest.param(3, 1, 8, "exchange", "flat", "auto", id="3-processes-exchange"),
    pytest.param(2, 2, 9, "exchange", "flat", "auto", id="2x2-exchange", marks=newest_jax_only),
    pytest.param(4, 2, 10, "exchange", "flat", "auto", id="4x2-exchange", marks=newest_jax_only),
]


@pytest.mark.parametrize("nproc,devices,seed,topology,tiers,transport", ACROSS_PROCESSES)
def test_allreduce_across_processes_matches_numpy(nproc, devices, seed, topology, tiers, transport):
    # 48 cases: every dtype under every op, random sizes, rings and chunks.
    # With the exchange on for small operands (up to 64 KiB here), "auto"
    # mixes it with the ring in one job where it runs the ring plan
    # (without the host segment); with the segment it runs direct.
    r = run_launcher(
        nproc,
        "allreduce_check.py",
        seed,
        48,
        topology,
        devices_per_process=devices,
        env={"JAXRING_EXCHANGE_MAX_BYTES": "65536", "JAXRING_TRANSPORT": transport},
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    by_rank = reports_by_rank(r.stdout)
    assert sorted(by_rank) == list(range(nproc))
    digests = {}
    for rank, said in by_rank.items():
        done = one(said, "done")
        lowered = one(said, "lowered")
        # The custom call carries the tiers the plan runs (none: flat).
        assert lowered["topology"] == tiers, lowered
        # A 4 MiB allreduce runs the algorithm asked for; under "auto",
        # direct over the host segment (every process here is on one host;
        # JAXRING_TRANSPORT=tcp turns the segment off), else the ring plan.
        # A 64-byte one runs exchange where the topology is left to "auto"
        # and the algorithm is not direct (and exchange_max_bytes asks for
        # it, as here).
        direct = topology == "auto" and transport == "auto"
        if topology in ("ring", "exchange"):
            algorithm = topology
        else:
            algorithm = "direct" if direct else "ring"
        assert lowered["algorithm"] == algorithm, lowered
        small = "direct" if direct else "exchange" if topology in ("auto", "exchange") else "ring"
        assert lowered["small_algorithm"] == small, lowered
        digests[rank] = of_kind(said, "check")
        assert len(digests[rank]) == 48
        by_device = done["data_frames"]["device_thread"]
        by_sender = done["data_frames"]["sender_thread"]
        # Once a connection is open, the devices' threads write the frames
        # that find it free. Direct sends none: every case went through the
        # host segment.
        if direct:
            assert by_device == by_sender == 0, (by_device, by_sender)
        else:
            assert by_device > 0, (by_device, by_sender)
    # Every rank got the same bits.
    assert all(d == digests[0] for d in digests.values())


@pytest.mark.parametrize(
    "devices,transport",
    [
        pytest.param(1, "auto", id="2-processes"),
        pytest.param(1, "tcp", id="2-processes-tcp", marks=newest_jax_only),
        pytest.param(2, "auto", id="2x2", marks=newest_jax_only),
    ],
)
def test_allreduce_in_a_loop_body_meets_the_same_iteration_on_every_rank(devices, transport):
    # XLA runs a call in a scan's or a fori_loop's body under one key for
    # the whole run: a rank's next iteration once joined a peer's current
    # one (direct: a wrong sum, then a timeout; the ring: a protocol error).
    r = run_launcher(
        2,
        "loop_check.py",
        40,
        1000,
        "auto,ring,exchange",
        devices_per_process=devices,
        env={"JAXRING_TRANSPORT": transport, "JAXRING_TIMEOUT_S": "60"},
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    by_rank = reports_by_rank(r.stdout)
    for rank in (0, 1):
        assert [s for s in by_rank[rank] if s["kind"] in ("loop", "done")] == [
            {"kind": "loop", "algorithm": "auto", "ok": True},
            {"kind": "loop", "algorithm": "ring", "ok": True},
            {"kind": "loop", "algorithm": "exchange", "ok": True},
            {"kind": "done"},
        ], by_rank[rank][-5:]


@pytest.mark.parametrize(
    "tiers,split",
    [
        pytest.param("2x2x2", (2, 4), id="2x2x2-over-2-processes", marks=newest_jax_only),
        pytest.param("2x4", (4, 2), id="2x4-over-4-processes", marks=newest_jax_only),
        pytest.param("exchange", (2, 4), id="exchange-over-2-processes", marks=newest_jax_only),
    ],
)
def test_tiered_plan_gives_the_same_bits_in_memory_and_over_tcp(tiers, split):
    # The same plan and inputs, once with every rank in one process (every
    # unit moves in memory) and twice split over processes (units that
    # cross them go through shared-memory rings, then over TCP with
    # JAXRING_TRANSPORT=tcp): the plan fixes the summation order, so the
    # bits are the same, whichever link carried each partial sum.
    nproc, devices = split
    digests = {}
    for where, (n, d) in (
        ("memory", (1, 8)),
        ("auto", (nproc, devices)),
        ("tcp", (nproc, devices)),
    ):
        r = run_launcher(
            n,
            "allreduce_check.py",
            7,
            24,
            tiers,
            devices_per_process=d,
            env={"JAXRING_TRANSPORT": "tcp" if where == "tcp" else "auto"},
        )
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        by_rank = reports_by_rank(r.stdout)
        lowered = "flat" if tiers == "exchange" else tiers
        for said in by_rank.values():
            done = one(said, "done")
            assert one(said, "lowered")["topology"] == lowered, said[-5:]
            links = done["shm_links"]
            assert (links > 0) == (where == "auto"), (where, links)
        digests[where] = same_checks(by_rank)  # every process got the same bits
        assert len(digests[where]) == 24
    assert digests["memory"] == digests["auto"] == digests["tcp"]


@pytest.mark.parametrize(
    "split",
    [
        pytest.param((2, 2), id="2-processes-of-2"),
        pytest.param((4, 1), id="4-processes", marks=newest_jax_only),
    ],
)
def test_direct_across_processes_gives_the_bits_of_direct_in_memory(split):
    # algorithm="direct" across the processes of this host runs over the
    # host segment: every rank's share summed over the ranks in rank order,
    # as the direct algorithm in one process sums it, so the bits are the
    # same for every dtype and op (sizes up to 12 MiB: many chunks), and no
    # data frame crosses a socket.
    digests = {}
    for n, d in ((1, 4), split):
        r = run_launcher(n, "allreduce_check.py", 11, 24, "direct", devices_per_process=d)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        by_rank = reports_by_rank(r.stdout)
        assert sorted(by_rank) == list(range(n))
        for said in by_rank.values():
            done = one(said, "done")
            lowered = one(said, "lowered")
            for field, want in (
                ("algorithm", "direct"),
                ("small_algorithm", "direct"),
                ("topology", "flat"),
            ):
                assert lowered[field] == want, (field, lowered)
            # Available across processes, and nothing left pending.
            host_direct = done["host_direct"]
            assert (host_direct["available"], host_direct["pending_ops"]) == (n > 1, 0), done
            assert done["data_frames"] == dict.fromkeys(
                ("device_thread", "sender_thread", "finished_by_sender_thread"), 0
            ), done
        digests[n] = same_checks(by_rank)  # every process got the same bits
        assert len(digests[n]) == 24
    assert digests[1] == digests[split[0]]


@newest_jax_only
def test_direct_groups_waiting_for_stragglers_are_not_another_program():
    # Two groups of one call site wait at once, one for processes 2.5 s
    # late: more than the 1 s after which a rank looks for peers in another
    # program, which must not take the other group for one.
    r = run_launcher(4, "direct_straggler.py", 2.5)
    by_rank = output_by_rank(r.stdout)
    assert sorted(by_rank) == list(range(4)), r.stdout[-3000:] + r.stderr[-3000:]
    for rank, lines in by_rank.items():
        assert lines == [{"kind": "ok"}], (rank, lines)


@newest_jax_only
def test_processes_with_different_transports_settle_on_one_answer_at_once():
    """One process of three asks for TCP only (JAXRING_TRANSPORT=tcp), the
    others for shared memory: every process is told that the host segment
    is off because of that process, "auto" runs the ring everywhere, and
    the first allreduce takes nothing like its 30 s timeout."""
    r = run_launcher(3, "mixed_transport.py")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    by_rank = reports_by_rank(r.stdout)
    assert sorted(by_rank) == [0, 1, 2], r.stdout[-3000:]
    for rank, said in by_rank.items():
        result = one(said, "result")
        assert (result["host_direct"], result["host_direct_unavailable"]) == (
            False,
            "process 2: JAXRING_TRANSPORT=tcp keeps every byte between processes on sockets",
        ), (rank, result)
        assert result["algorithm"] == "ring", (rank, result)
        assert result["took_s"] < 15, (rank, result)
        assert result["correct"] is True, (rank, result)


@newest_jax_only
def test_direct_across_processes_is_refused_where_there_is_no_host_segment():
    r = run_launcher(2, "allreduce_check.py", 0, 1, "direct", env={"JAXRING_TRANSPORT": "tcp"})
    out = " ".join((r.stdout + r.stderr).split())
    assert r.returncode != 0
    assert "ValueError: jaxring: algorithm='direct' across processes" in out, out[-2000:]
    assert "JAXRING_TRANSPORT=tcp keeps every byte" in out, out[-2000:]


@newest_jax_only
@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_frames_a_small_socket_buffer_takes_in_parts_arrive_whole(transport):
    # With 4 KiB socket buffers the socket takes a 1 MiB frame in many
    # parts: the device's thread writes the first, the connection's sender
    # thread the rest. Over shared memory only the headers use the socket,
    # and the sender thread finishes one only when the reader falls a dozen
    # frames behind: that happens (7 to 22 times a run here) but is not
    # required. The bits must be those of a run with the kernel's buffers.
    digests = {}
    for buffer in ("", "4096"):
        r = run_launcher(
            3,
            "allreduce_check.py",
            11,
            12,
            "flat",
            env={"JAXRING_TRANSPORT": transport, "JAXRING_TCP_SOCKET_BUFFER": buffer},
        )
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        by_rank = reports_by_rank(r.stdout)
        split = 0
        for said in by_rank.values():
            done = one(said, "done")
            assert done["socket_buffer"] == (int(buffer) if buffer else None), done
            split += done["data_frames"]["finished_by_sender_thread"]
        if buffer and transport == "tcp":
            assert split > 0, "no frame was finished by a sender thread"
        digests[buffer] = same_checks(by_rank)
    assert digests[""] == digests["4096"]


@newest_jax_only
def test_a_socket_buffer_outside_its_range_is_refused():
    r = run_launcher(2, "allreduce_check.py", 0, 1, "flat", env={"JAXRING_TCP_SOCKET_BUFFER": "12"})
    assert r.returncode != 0
    assert "JAXRING_TCP_SOCKET_BUFFER='12' is not a whole number of bytes" in (
        r.stdout + r.stderr
    ), r.stdout[-2000:] + r.stderr[-2000:]


def test_a_socket_buffer_is_read_in_ascii_digits_only(monkeypatch):
    from jaxring._src import distributed

    for raw in ("\u00b2", "4096\u00b2", "\u0664\u0660\u0669\u0666"):  # ², Arabic-Indic 4096
        monkeypatch.setenv("JAXRING_TCP_SOCKET_BUFFER", raw)
        with pytest.raises(ValueError, match="is not a whole number of bytes"):
            distributed.socket_buffer_choice()
    monkeypatch.setenv("JAXRING_TCP_SOCKET_BUFFER", " 4096 ")
    assert distributed.socket_buffer_choice() == 4096


@pytest.mark.parametrize(
    "raw,says",
    [
        ("abc", "it holds 3 characters (fewer than 32). Set it to the output of"),
        ("a" * 33, "it holds 33 characters (an odd number). Set it"),
        (
            "g" + "a" * 31,
            "it holds 32 characters, of which 1 (at position 1) is not a hexadecimal digit. Set it",
        ),
        (
            "ax" * 600,
            "it holds 1200 characters (more than 1024), of which 600 (at "
            "position 2, 4, 6, 8, 10, ...) are not hexadecimal digits",
        ),
    ],
    ids=["short", "odd", "not-hex", "long-and-not-hex"],
)
def test_a_bad_job_secret_says_what_is_wrong_with_it(raw, says):
    from jaxring._src import distributed

    with pytest.raises(
        ValueError,
        match=re.escape(
            "JAXRING_JOB_SECRET must be 32 to 1024 hexadecimal digits, an even "
            "number of them (at least 128 bits); " + says
        ),
    ) as raised:
        distributed.secret_from_env({"JAXRING_JOB_SECRET": raw})
    assert "secrets.token_hex(32)" in str(raised.value)
    assert raw not in str(raised.value)  # the secret itself is never quoted
    assert distributed.secret_from_env({"JAXRING_JOB_SECRET": "ab" * 16}) == b"\xab" * 16


@pytest.mark.parametrize(
    "algorithm,differ",
    [
        ("auto", "count"),
        pytest.param("direct", "count", marks=newest_jax_only),
        pytest.param("direct", "shape", marks=newest_jax_only),
        pytest.param("ring", "shape", marks=newest_jax_only),
    ],
)
def test_different_programs_fail_fast_on_every_rank(algorithm, differ):
    # "shape": the same element count in another shape, which only the
    # operands' shape digest tells apart.
    timeout_s = 60
    r = run_launcher(2, "mismatch.py", timeout_s, differ, env={"JAXRING_ALGORITHM": algorithm})
    by_rank = reports_by_rank(r.stdout)
    for rank in (0, 1):
        raised = of_kind(by_rank[rank], "raised")
        assert raised, r.stdout[-3000:]
        said, message = raised[0], raised[0]["message"]
        assert said["took_s"] < timeout_s / 2, said
        assert said["error"] == "MismatchError", said
        assert "different programs" in message, said
        if differ == "count":
            assert "1024 x float32" in message and "2048 x float32" in message, said
        else:
            assert "operands of other shapes" in message, said


@pytest.mark.parametrize(
    "setting,named",
    [
        (
            "ring",
            "this process (1) the ring (algorithm 'ring', topology 'auto', tuning "
            "'auto (no table for this job)')",
        ),
        pytest.param(
            "tuning",
            "this process (1) the ring (algorithm 'auto', topology 'auto', tuning ",
            marks=newest_jax_only,
        ),
        pytest.param("direct", None, marks=newest_jax_only),
    ],
)
def test_processes_of_one_host_whose_settings_choose_differently_fail_at_lowering(setting, named):
    # Process 1 would run the ring while process 0 waits for it in the
    # host segment: neither would see the other's description. Settings
    # that choose alike ("direct" where "auto" runs direct) are no error.
    timeout_s = 60
    with tempfile.TemporaryDirectory() as cache:
        r = run_launcher(
            2,
            "settings_mismatch.py",
            setting,
            timeout_s,
            env={"JAXRING_TUNING": "auto", "XDG_CACHE_HOME": cache},
        )
    by_rank = reports_by_rank(r.stdout)
    for rank, other in ((0, 1), (1, 0)):
        ended = [s for s in by_rank[rank] if s["kind"] in ("raised", "no_error")]
        assert ended, r.stdout[-3000:] + r.stderr[-3000:]
        if named is None:
            assert ended == [{"kind": "no_error"}], ended
            continue
        said = ended[0]
        assert said["kind"] == "raised" and said["took_s"] < timeout_s / 2, said
        assert said["error"] == "MismatchError", said
        assert f"process {other} runs" in said["message"], said
        assert "choose differently" in said["message"], said
    if named is not None:
        assert named in " ".join(s["message"] for s in of_kind(by_rank[1], "raised")), r.stdout


@pytest.mark.parametrize("algorithm", ["auto", pytest.param("ring", marks=newest_jax_only)])
def test_timeline_across_processes_names_every_iteration_of_a_loop(algorithm):
    # auto runs direct over the host segment, ring the shared-memory links;
    # in a loop's body both run each iteration under an op id of their own.
    r = run_launcher(2, "timeline_check.py", algorithm)
    by_rank = output_by_rank(r.stdout)
    for rank in (0, 1):
        assert by_rank[rank][-1:] == [{"kind": "done"}], r.stdout[-3000:] + r.stderr[-3000:]
        spans = [s["names"] for s in of_kind(by_rank[rank], "spans")]
        assert spans == [["allreduce max over x"] * 3 + ["allreduce sum over x"]], by_rank[rank]


def test_a_function_only_one_process_lowered_does_not_shift_the_others():
    r = run_launcher(2, "uneven_lowering.py", 20, devices_per_process=2)
    by_rank = output_by_rank(r.stdout)
    for rank in (0, 1):
        assert by_rank[rank] and by_rank[rank][-1] == {"kind": "ok"}, (
            r.stdout[-3000:] + r.stderr[-2000:]
        )


@pytest.mark.parametrize(
    "nproc,devices,algorithm",
    [
        (2, 2, "auto"),
        pytest.param(4, 1, "auto", marks=newest_jax_only),
        # Groups of one host's processes over its segment, several at once.
        pytest.param(4, 1, "direct", marks=newest_jax_only),
    ],
)
def test_axis_index_groups_across_processes_match_numpy(nproc, devices, algorithm):
    r = run_launcher(
        nproc, "grouped_check.py", devices_per_process=devices, env={"JAXRING_ALGORITHM": algorithm}
    )
    by_rank = output_by_rank(r.stdout)
    assert sorted(by_rank) == list(range(nproc)), r.stdout[-3000:] + r.stderr[-3000:]
    for lines in by_rank.values():
        assert lines == [
            {"kind": "check", "grouping": "across"},
            {"kind": "check", "grouping": "uneven"},
            {"kind": "check", "grouping": "reversed"},
            {"kind": "ok"},
        ], r.stdout[-3000:] + r.stderr[-2000:]


@newest_jax_only
def test_launcher_stops_everyone_when_one_process_fails():
    start = time.monotonic()
    r = run_launcher(3, "exit_code.py", timeout=120)
    assert r.returncode == 7, r.stdout + r.stderr
    assert time.monotonic() - start < 60
    by_rank = reports_by_rank(r.stdout)
    assert {"kind": "failing", "status": 7} in by_rank[1], by_rank[1]
    assert "process 1 exited with status 7" in r.stderr
    pids = [s["pid"] for said in by_rank.values() for s in of_kind(said, "pid")]
    assert len(pids) == 3
    for pid in pids:  # nobody left behind
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_script_that_initializes_jax_distributed_itself_runs_under_the_launcher():
    """A cluster-style script (a bare jax.distributed.initialize()) runs as
    is, and a call that asks for another job says why not. Started as the
    docs say, from the checkout's root, where `python -m` would import the
    source tree: the console script, or the same without its directory on
    sys.path."""
    root = Path(__file__).resolve().parents[1]
    console = Path(sys.executable).with_name("jaxring-launch")
    launcher = (
        [str(console)] if console.exists() else [sys.executable, "-P", "-m", "jaxring.launch"]
    )
    r = subprocess.run(
        [*launcher, "-n", "2", "--devices-per-process", "1", str(SCRIPTS / "bare_initialize.py")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=root,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    by_rank = reports_by_rank(r.stdout)
    assert sorted(by_rank) == [0, 1], r.stdout
    for rank, said in by_rank.items():
        assert {"kind": "process", "index": rank, "count": 2} in said, said
        sums = of_kind(said, "sum")
        assert sums == [{"kind": "sum", "got": [3.0, 5.0, 7.0], "want": [3.0, 5.0, 7.0]}], said
        refused = of_kind(said, "refused")
        assert len(refused) == 1, said
        assert refused[0]["message"].startswith(
            "jax.distributed.initialize(num_processes=3): "
            "jaxring.launch already initialized jax.distributed in this "
            f"process, as process {rank} of 2"
        ), refused


@newest_jax_only
def test_launcher_prefixes_output_and_passes_arguments(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text(
        "import sys, jax\nprint('hello', jax.process_index(), jax.process_count(), sys.argv[1:])\n"
    )
    with tempfile.TemporaryDirectory() as cwd:
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "jaxring.launch",
                "-n",
                "2",
                "--devices-per-process",
                "1",
                str(script),
                "a",
                "--flag",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=cwd,
        )
    assert r.returncode == 0, r.stderr
    by_rank = lines_by_rank(r.stdout)
    assert "hello 0 2 ['a', '--flag']" in by_rank[0]
    assert "hello 1 2 ['a', '--flag']" in by_rank[1]


@newest_jax_only
def test_launcher_runs_a_module_with_its_own_arguments(tmp_path):
    (tmp_path / "hello_module.py").write_text(
        "import sys, jax\nprint('module', __name__, jax.process_index(), sys.argv[1:])\n"
    )
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxring.launch",
            "-n",
            "2",
            "--devices-per-process",
            "1",
            "-m",
            "hello_module",
            "-n",
            "7",
            "-m",
            "x",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    by_rank = lines_by_rank(r.stdout)
    # Everything after the module's name is the module's, -n and -m too.
    assert "module __main__ 0 ['-n', '7', '-m', 'x']" in by_rank[0]
    assert "module __main__ 1 ['-n', '7', '-m', 'x']" in by_rank[1]
    # A script's arguments may hold -m as well.
    args = launch.parse_args(["-n", "2", "train.py", "-m", "x"])
    assert (args.script, args.module, args.args) == ("train.py", None, ["-m", "x"])
    args = launch.parse_args(["-n", "2", "-m", "mod", "x.py"])
    assert (args.script, args.module, args.args) == (None, "mod", ["x.py"])


@newest_jax_only
def test_launcher_binds_each_process_to_its_share_of_the_cpus(tmp_path):
    script = tmp_path / "affinity.py"
    script.write_text(
        REPORT_SOURCE + "import os, threading, jax\n"
        "seen = {}\n"
        "t = threading.Thread(target=lambda: seen.update(t=os.sched_getaffinity(0)))\n"
        "t.start(); t.join()\n"
        "report('cpus', process=jax.process_index(), main=sorted(os.sched_getaffinity(0)),\n"
        "       thread=sorted(seen['t']))\n"
    )
    mine = sorted(os.sched_getaffinity(0))
    for nproc in (2, 3):
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "jaxring.launch",
                "-n",
                str(nproc),
                "--devices-per-process",
                "1",
                "--cpu-bind",
                "cores",
                str(script),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )
        assert r.returncode == 0, r.stderr
        by_rank = reports_by_rank(r.stdout)
        shares = launch.cpu_shares(nproc, launch.physical_cores(mine))
        for rank in range(nproc):
            # The process and the threads it starts later keep its share.
            cpus = {"kind": "cpus", "process": rank, "main": shares[rank], "thread": shares[rank]}
            assert cpus in by_rank[rank], by_rank[rank]
    # Without --cpu-bind the kernel places the processes: no binding.
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxring.launch",
            "-n",
            "2",
            "--devices-per-process",
            "1",
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    cpus = {"kind": "cpus", "process": 1, "main": mine, "thread": mine}
    assert cpus in reports_by_rank(r.stdout)[1], r.stdout


@newest_jax_only
def test_keep_freed_memory_has_glibc_reuse_a_freed_buffer(tmp_path):
    """--keep-freed-memory: a 64 MiB buffer freed and allocated again lands
    on the pages already touched (no page faults), also when a thread other
    than the main one allocates it (as XLA's threads allocate results);
    without it, glibc maps fresh pages each time, which fault in as they are
    written."""
    script = tmp_path / "refault.py"
    script.write_text(
        REPORT_SOURCE + "import ctypes, resource, threading, jax\n"
        "libc = ctypes.CDLL('libc.so.6')\n"
        "libc.malloc.restype = ctypes.c_void_p\n"
        "libc.free.argtypes = [ctypes.c_void_p]\n"
        "libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]\n"
        "def refaults(out):\n"
        "    faults = []\n"
        "    for _ in range(3):\n"
        "        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
        "        p = libc.malloc(64 << 20); libc.memset(p, 1, 64 << 20)\n"
        "        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)\n"
        "        libc.free(p)\n"
        "    out.append(min(faults[1:]))\n"
        "main, other = [], []\n"
        "refaults(main)\n"
        "t = threading.Thread(target=refaults, args=(other,)); t.start(); t.join()\n"
        "report('faults', process=jax.process_index(), main=main[0], other=other[0])\n"
    )

    def refaults(*flags):
        r = subprocess.run(
            [sys.executable, "-m", "jaxring.launch", "-n", "2", *flags, str(script)],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
            env={k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")},
        )
        assert r.returncode == 0, r.stderr
        by_rank = output_by_rank(r.stdout)
        # Each process's last line.
        last = [by_rank[rank][-1] for rank in range(2)]
        assert all(isinstance(s, dict) and s["kind"] == "faults" for s in last), last
        return [(s["main"], s["other"]) for s in last]

    # 64 MiB is 16384 pages of 4 KiB (or 32 huge pages of 2 MiB); the main
    # thread's and another thread's buffer, per process.
    assert all(f >= 32 for faults in refaults() for f in faults), refaults()
    assert refaults("--keep-freed-memory") == [(0, 0), (0, 0)]
    # A setting of the caller's own is left as it is.
    env = launch.child_env(
        {"MALLOC_TRIM_THRESHOLD_": "7"}, 0, 1, "h:1", None, "s", keep_freed_memory=True
    )
    assert env["MALLOC_TRIM_THRESHOLD_"] == "7" and env["MALLOC_MMAP_THRESHOLD_"] == str(1 << 30)
    assert env["MALLOC_ARENA_MAX"] == "1"
    assert "MALLOC_MMAP_THRESHOLD_" not in launch.child_env({}, 0, 1, "h:1", None, "s")


def test_cpu_shares_are_whole_cores_and_disjoint_while_there_are_cores_enough():
    # Two cores with two hardware threads each, numbered as Linux usually
    # does (core i's siblings are i and i + 2): a process gets a core.
    ht = [[0, 2], [1, 3]]
    assert launch.cpu_shares(2, ht) == [[0, 2], [1, 3]]
    assert launch.cpu_shares(1, ht) == [[0, 1, 2, 3]]
    assert launch.cpu_shares(3, [[1], [3], [5], [7]]) == [[1], [3], [5, 7]]
    # Oversubscribed: one core each, in turn, as mpirun binds.
    assert launch.cpu_shares(4, [[0], [1]]) == [[0], [1], [0], [1]]
    assert launch.cpu_shares(3, ht) == [[0, 2], [1, 3], [0, 2]]
    # This machine's CPUs, grouped by core, cover its affinity once.
    mine = os.sched_getaffinity(0)
    cores = launch.physical_cores(mine)
    assert sorted(c for core in cores for c in core) == sorted(mine)


@newest_jax_only
def test_launcher_rejects_bad_arguments():
    r = subprocess.run(
        [sys.executable, "-m", "jaxring.launch", "-n", "0", "x.py"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tempfile.gettempdir(),
    )
    assert r.returncode != 0 and "-n must be at least 1" in r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "jaxring.launch", "-n", "2"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tempfile.gettempdir(),
    )
    assert r.returncode != 0 and "give the script to run (or -m MODULE)" in r.stderr


class Job:
    """N processes of fault_loop.py started with the launcher's environment,
    so the test itself can kill or stop one of them. `lines` holds what each
    printed (stdout and stderr), without a prefix; reports(lines[rank])
    reads its reports."""

    def __init__(
        self,
        nproc: int,
        timeout_s: float,
        script: str = "fault_loop.py",
        secret: str | None = None,
        args: tuple = (),
    ):
        coordinator = f"127.0.0.1:{launch._free_port()}"
        self.secret = secret or launch.new_secret_hex()
        self.cwd = tempfile.TemporaryDirectory()
        self.procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "jaxring._src.launched",
                    str(SCRIPTS / script),
                    str(timeout_s),
                    *map(str, args),
                ],
                env=launch.child_env(os.environ, rank, nproc, coordinator, 1, self.secret),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                cwd=self.cwd.name,
            )
            for rank in range(nproc)
        ]
        self.lines = {rank: [] for rank in range(nproc)}
        for rank, p in enumerate(self.procs):
            threading.Thread(target=self._pump, args=(rank, p), daemon=True).start()

    def _pump(self, rank, p):
        for line in p.stdout:
            self.lines[rank].append(line.rstrip())

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not all(of_kind(reports(ls), "ready") for ls in self.lines.values()):
            assert time.monotonic() < deadline, self.lines
            assert all(p.poll() is None for p in self.procs), self.lines
            time.sleep(0.05)

    def raised_at(self, rank: int, timeout: float) -> float:
        """Wall time at which `rank` raised; fails if it hung or died otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            raised = of_kind(reports(self.lines[rank]), "raised")
            if raised:
                return raised[0]["at"]
            if self.procs[rank].poll() is not None:
                time.sleep(0.2)  # let the pump read the last lines
                if not of_kind(reports(self.lines[rank]), "raised"):
                    pytest.fail(
                        f"rank {rank} exited with {self.procs[rank].returncode} "
                        f"without raising: {self.lines[rank][-10:]}"
                    )
            elif time.monotonic() > deadline:
                self.kill_all()
                pytest.fail(
                    f"rank {rank} did not raise within {timeout} s: {self.lines[rank][-5:]}"
                )
            time.sleep(0.02)

    def kill_all(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        self.cwd.cleanup()


@pytest.mark.slow
def test_killed_peer_makes_every_survivor_raise_twenty_times():
    """Kill one of 4 processes mid-sequence, 20 times: every survivor raises
    within the timeout plus a few seconds, names the lost process, and no
    process is left behind.

    The victim is never process 0: it hosts jax.distributed's coordination
    service, and when that dies JAX itself terminates every other process
    (LOG(FATAL) "the JAX distributed service detected fatal errors") before
    any Python code can run."""
    timeout_s = 10.0
    bound_s = timeout_s + 5.0
    rng = random.Random(0)
    for trial in range(20):
        job = Job(4, timeout_s)
        try:
            job.wait_ready()
            time.sleep(rng.uniform(0.0, 0.2))  # land anywhere in an allreduce
            victim = rng.randrange(1, 4)
            killed_at = time.time()
            job.procs[victim].kill()
            for rank in range(4):
                if rank == victim:
                    continue
                raised = job.raised_at(rank, bound_s + 10)
                assert raised - killed_at < bound_s, (trial, rank, raised - killed_at)
                said = of_kind(reports(job.lines[rank]), "raised")[0]
                assert "jaxring allreduce" in said["message"], said
                assert (said["error"], said["peer"]) == ("PeerLostError", victim), said
        finally:
            job.kill_all()


def jaxring_segments(job_id: str = "") -> set[str]:
    """jaxring's shared-memory segments in /dev/shm (shm_link.h,
    host_segment.h), those of one job where its id (hex) is given: other
    jobs on this machine, another test run's, may hold theirs."""
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith(f"jaxring-{job_id}")}
    except FileNotFoundError:
        return set()


@pytest.mark.parametrize("algorithm", ["ring", pytest.param("direct", marks=newest_jax_only)])
def test_killed_peer_on_shared_memory_is_named_and_leaves_nothing_in_dev_shm(algorithm):
    """Three processes on this host exchange 16 MiB allreduces through
    shared memory: rings between pairs of processes ("ring"), or the host
    segment ("direct", which "auto" takes here). While they run, /dev/shm holds no segment of the
    job (each is unlinked once its peers mapped it); a process killed
    mid-operation makes both survivors raise PeerLostError naming it, well
    before the 30 s timeout (its sockets close; its pid ends), and
    afterwards /dev/shm still holds nothing of the job."""
    job = Job(3, 30.0, args=(1 << 22, algorithm))
    try:
        job.wait_ready()
        for rank in range(3):
            ready = of_kind(reports(job.lines[rank]), "ready")[0]
            if algorithm == "direct":
                assert ready["direct"] is True, ready
            else:
                assert ready["shm_links"] > 0, ready
        job_id = ready["job_id"]
        assert len(job_id) == 32, ready
        assert jaxring_segments(job_id) == set()
        time.sleep(0.1)
        killed_at = time.time()
        job.procs[2].kill()
        for rank in (0, 1):
            raised = job.raised_at(rank, 40)
            assert raised - killed_at < 10, (rank, raised - killed_at)
            said = of_kind(reports(job.lines[rank]), "raised")[0]
            assert (said["error"], said["peer"]) == ("PeerLostError", 2), said
    finally:
        job.kill_all()
    assert jaxring_segments(job_id) == set()


# The host segment's set-up cut short (tests/multiprocess/setup_exit.py):
# process 1 reports "saw" with the name, and that /dev/shm holds it, once
# process 0 has created and published the segment, so each test knows the
# name was in /dev/shm.


def host_segment_seen(lines: list[str]) -> str:
    """The file in /dev/shm that process 1 saw (it must have been there),
    from the lines it printed."""
    saw = next(iter(of_kind(reports(lines), "saw")), None)
    assert saw is not None, lines[-10:]
    assert saw["exists"] is True and "-host-" in saw["name"], saw
    return "/dev/shm" + saw["name"]


def remove_files(paths) -> None:
    """A test's own leftovers, so that a failed test leaves nothing either."""
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def wait_for_report(job: "Job", rank: int, kind: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not of_kind(reports(job.lines[rank]), kind):
        assert job.procs[rank].poll() is None, job.lines
        assert time.monotonic() < deadline, job.lines
        time.sleep(0.05)


@newest_jax_only
def test_an_error_in_the_host_segments_set_up_leaves_nothing_in_dev_shm():
    """Process 0 raises in its set-up after every process mapped the
    segment, before the commit that would unlink it: the exception removes
    the name on its way out."""
    r = run_launcher(2, "setup_exit.py", 60, "raise")
    path = host_segment_seen(lines_by_rank(r.stdout)[1])
    try:
        assert r.returncode == 1, r.stdout[-3000:]
        assert "injected failure after the decision" in r.stdout, r.stdout[-3000:]
        assert not os.path.exists(path)
    finally:
        remove_files([path])


@newest_jax_only
def test_a_process_that_dies_in_set_up_leaves_nothing_of_the_job_in_dev_shm():
    """Process 1 exits while process 0 waits for it to map the segment; the
    launcher then stops process 0 with SIGTERM (which JAX takes as a
    preemption notice, so the process runs on) and SIGKILL after its grace.
    The SIGTERM removes the name."""
    r = run_launcher(2, "setup_exit.py", 60, "exit")
    path = host_segment_seen(lines_by_rank(r.stdout)[1])
    try:
        assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
        assert "process 1 exited with status 1" in r.stderr, r.stderr[-3000:]
        assert not os.path.exists(path)
    finally:
        remove_files([path])


@pytest.mark.parametrize(
    "sig",
    [
        pytest.param(signal.SIGTERM, id="SIGTERM"),
        pytest.param(signal.SIGINT, id="SIGINT", marks=newest_jax_only),
    ],
)
def test_a_signal_to_process_0_in_set_up_removes_the_segment_at_once(sig):
    """Process 1 never maps the segment, and process 0 waits up to 120 s for
    it to say so (a wait that neither signal interrupts). The signal
    removes the name at once: within a quarter of that wait, which ends no
    earlier than 120 s after the name was published."""
    job = Job(2, 120.0, script="setup_exit.py", args=("hold",))
    path = None
    try:
        wait_for_report(job, 1, "saw")
        path = host_segment_seen(job.lines[1])
        job.procs[0].send_signal(sig)
        deadline = time.monotonic() + 30
        while os.path.exists(path):
            assert time.monotonic() < deadline, (path, job.lines[0][-5:])
            time.sleep(0.05)
    finally:
        job.kill_all()
        if path is not None:
            remove_files([path])


@newest_jax_only
def test_the_next_job_removes_a_segment_whose_creator_was_killed_but_no_live_ones():
    """A job whose process 0 is killed outright (SIGKILL) in set-up leaves
    its host segment; another job is in its set-up, its process 0 alive.
    The next job removes the first segment and keeps the second."""
    killed = Job(2, 120.0, script="setup_exit.py", args=("hold",))
    live = None
    paths = []
    try:
        wait_for_report(killed, 1, "saw")
        paths.append(host_segment_seen(killed.lines[1]))
        killed.procs[0].kill()
        killed.procs[0].wait()  # reaped: a zombie's pid still answers kill(pid, 0)
        killed.kill_all()
        assert os.path.exists(paths[0])
        live = Job(2, 120.0, script="setup_exit.py", args=("hold",))
        wait_for_report(live, 1, "saw")
        paths.append(host_segment_seen(live.lines[1]))
        r = run_launcher(2, "setup_exit.py", 60, "run")
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        done = {rank: of_kind(said, "done") for rank, said in reports_by_rank(r.stdout).items()}
        want = [{"kind": "done", "host_direct": True}]
        assert done == {0: want, 1: want}, r.stdout[-3000:]
        assert not os.path.exists(paths[0])
        assert os.path.exists(paths[1])
    finally:
        killed.kill_all()
        if live is not None:
            live.kill_all()
        remove_files(paths)


@newest_jax_only
@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="needs root and unshare(1) to give the job a tiny /dev/shm",
)
def test_a_dev_shm_too_small_falls_back_to_tcp_saying_so_once():
    """Both processes see a /dev/shm of 1 MiB (a mount namespace of their
    own), too small for a ring: each says once that it uses TCP, and the
    results are still right."""
    inner = (
        f"mount -t tmpfs -o size=1m tmpfs /dev/shm && exec {sys.executable} "
        f"-m jaxring.launch -n 2 --devices-per-process 1 "
        f"{SCRIPTS / 'allreduce_check.py'} 0 6"
    )
    with tempfile.TemporaryDirectory() as cwd:
        r = subprocess.run(
            ["unshare", "--mount", "sh", "-c", inner],
            capture_output=True,
            text=True,
            timeout=240,
            cwd=cwd,
        )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    by_rank = reports_by_rank(r.stdout)
    for rank in (0, 1):
        assert of_kind(by_rank[rank], "done"), out[-3000:]
        said = [
            l
            for l in out.splitlines()
            if l.startswith(f"[{rank}] jaxring: process {rank} uses TCP instead of shared memory")
        ]
        assert len(said) == 1, out[-3000:]
        assert "cannot hold" in said[0], said


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None,
    reason="needs root and ip(8) for network namespaces",
)
@newest_jax_only
def test_processes_in_network_namespaces_share_memory_unless_told_apart():
    """Two processes in two network namespaces of one machine (they share
    /dev/shm) exchange through shared memory: the ring's links and the host
    segment of direct; with a JAXRING_HOST_ID per namespace, as the
    benchmarks' emulated hosts set, they use TCP and have no host
    segment."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
    import netns

    with netns.Network(2, None) as net:
        for prefix, shared in (
            (f"ip netns exec {net.tag}n{{rank}}", True),
            (net.exec_prefix(), False),
        ):
            with tempfile.TemporaryDirectory() as cwd:
                r = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "jaxring.launch",
                        "-n",
                        "2",
                        "--devices-per-process",
                        "1",
                        "--coordinator",
                        f"{net.address(0)}:{launch._free_port()}",
                        "--prefix-command",
                        prefix,
                        str(SCRIPTS / "allreduce_check.py"),
                        "0",
                        "6",
                        "ring",
                    ],
                    capture_output=True,
                    text=True,
                    timeout=240,
                    cwd=cwd,
                )
            assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
            for rank, said in reports_by_rank(r.stdout).items():
                done = one(said, "done")
                links = done["shm_links"]
                assert (links > 0) == shared, (prefix, rank, links)
                direct = done["host_direct"]["available"]
                assert direct is shared, (prefix, rank, direct)


def test_jaxring_transport_tcp_keeps_processes_on_sockets():
    """JAXRING_TRANSPORT=tcp: the same job, no shared-memory link."""
    os.environ["JAXRING_TRANSPORT"] = "tcp"
    try:
        job = Job(2, 10.0)
    finally:
        del os.environ["JAXRING_TRANSPORT"]
    try:
        job.wait_ready()
        for rank in range(2):
            ready = of_kind(reports(job.lines[rank]), "ready")[0]
            assert ready["shm_links"] == 0, ready
    finally:
        job.kill_all()


@newest_jax_only
@pytest.mark.parametrize("algorithm", ["ring", "direct"])
def test_stopped_peer_times_out_on_every_survivor(algorithm):
    """A peer that stops responding (SIGSTOP, sockets open) is caught by the
    operation's deadline."""
    timeout_s = 4.0
    job = Job(3, timeout_s, args=(1 << 16, algorithm))
    try:
        job.wait_ready()
        stopped_at = time.time()
        job.procs[1].send_signal(signal.SIGSTOP)
        for rank in (0, 2):
            raised = job.raised_at(rank, timeout_s + 20)
            assert raised - stopped_at < timeout_s + 5.0
            said = of_kind(reports(job.lines[rank]), "raised")[0]
            message = said["message"]
            assert said["error"] in ("CollectiveTimeoutError", "PeerLostError"), said
            if algorithm == "direct":
                # Every process's arrivals are in the host segment: the
                # survivors name the stopped one, and its pid.
                assert said["peer"] == 1, said
                assert f"waited for process 1 (pid {job.procs[1].pid})" in message, said
                continue
            assert "timed out" in message or "process 1" in message, said
            # A survivor whose two rings wait for different processes
            # cannot tell which of them stopped: the other survivor, itself
            # waiting on the stopped one, may be the one it names (seen
            # once in CI). Never itself.
            other = 2 - rank
            assert said["peer"] in (1, None, other), said
    finally:
        job.procs[1].send_signal(signal.SIGCONT)
        job.kill_all()


@pytest.mark.parametrize("algorithm", ["auto", pytest.param("ring", marks=newest_jax_only)])
def test_overlap_across_processes_matches_gloo_pmean(algorithm):
    # 2 processes x 2 devices: under "auto" the buckets run direct over the
    # host segment (several buckets in flight at once hold entries of it);
    # the ring's ride the links between the processes (shared memory, or
    # TCP) and memory inside each. The reference is lax.pmean over JAX's
    # Gloo.
    r = run_launcher(
        2, "overlap_check.py", devices_per_process=2, env={"JAXRING_ALGORITHM": algorithm}
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for rank, said in reports_by_rank(r.stdout).items():
        result = of_kind(said, "result")
        assert result, said[-5:]
        loss_diff, param_diff = result[0]["loss_diff"], result[0]["param_diff"]
        assert loss_diff < 1e-5 and param_diff < 1e-5, (rank, result[0])
        frames = result[0]["data_frames"]
        assert (frames == 0) == (algorithm == "auto"), (rank, frames)


def test_documented_script_gives_the_same_result_under_the_launcher(tmp_path):
    import re

    page = (Path(__file__).resolve().parents[1] / "docs" / "multiprocess.md").read_text()
    block = next(
        b for b in re.findall(r"```python\n(.*?)```", page, re.S) if "make_array_from_callback" in b
    )
    script = tmp_path / "total.py"
    script.write_text(block)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    single = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
    )
    assert single.returncode == 0, single.stderr[-2000:]
    want = [l for l in single.stdout.splitlines() if l.startswith("total")]
    assert want
    with tempfile.TemporaryDirectory() as cwd:
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "jaxring.launch",
                "-n",
                "2",
                "--devices-per-process",
                "4",
                str(script),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=cwd,
        )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    for rank, lines in lines_by_rank(r.stdout).items():
        assert [l for l in lines if l.startswith("total")] == want, (rank, lines)


@newest_jax_only
def test_link_emulation_is_refused_for_rings_across_processes():
    r = run_launcher(2, "link_refused.py")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    for rank, said in reports_by_rank(r.stdout).items():
        refused = of_kind(said, "refused")
        assert refused and "spans processes" in refused[0]["message"], (rank, said[-5:])


@newest_jax_only
def test_a_failed_tcp_setup_is_reported_again_not_retried():
    r = run_launcher(2, "setup_retry.py")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    said = reports_by_rank(r.stdout)[0]
    first = [s for s in of_kind(said, "attempt") if s["attempt"] == "first"]
    second = [s for s in of_kind(said, "attempt") if s["attempt"] == "second"]
    assert first and first[0]["raised"], said
    assert "process 1 did not publish its TCP address" in first[0]["message"], said
    assert second and second[0]["raised"], said
    assert "set-up failed earlier in this process" in second[0]["message"], said
    assert "process 1 did not publish its TCP address" in second[0]["message"], said


@newest_jax_only
def test_a_job_with_fewer_cores_than_ranks_runs_one_ring_unless_told_otherwise():
    # Every process of the job on one CPU: 0.5 cores per rank on any machine.
    # The default ring count drops to one; a count that was passed or set
    # stays, and every process lowers the same one.
    # The launcher starts pinned (its processes inherit the mask); a small
    # Python pins itself and execs it, since a preexec_fn would fork this
    # multithreaded process.
    pin_and_launch = (
        "import os, sys; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
        "os.execv(sys.executable, [sys.executable] + sys.argv[1:])"
    )
    with tempfile.TemporaryDirectory() as cwd:
        r = subprocess.run(
            [
                sys.executable,
                "-c",
                pin_and_launch,
                "-m",
                "jaxring.launch",
                "-n",
                "2",
                "--devices-per-process",
                "1",
                str(SCRIPTS / "crowded_rings.py"),
            ],
            capture_output=True,
            text=True,
            timeout=240,
            cwd=cwd,
            env={
                k: v for k, v in os.environ.items() if k not in ("JAXRING_RINGS", "JAXRING_TUNING")
            },
        )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for rank, said in reports_by_rank(r.stdout).items():
        rings = {s["setting"]: s["rings"] for s in of_kind(said, "rings")}
        assert rings == {
            "default": [1],
            "passed": [2],
            "overlap": [1],
            "set": [2],
            "overlap-set": [2],
        }, (rank, said)
        assert {"kind": "done", "cores_per_rank": 0.5} in said, (rank, said)
