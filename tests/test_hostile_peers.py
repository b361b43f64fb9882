"""jaxring's TCP transport as a network service: strangers, and a member
that misbehaves, against a running 2-process job.

The job (tests/multiprocess/hostile_target.py) keeps allreducing and checks
every result against numpy. Meanwhile these tests speak the wire format
(tcp_handshake.h, tcp_transport.cc) on loopback to process 0:

- as strangers, without the job's secret or with it for another job: each
  attack is turned away without touching the job. Afterwards every result
  was exact, no process was declared lost or died, and threads, descriptors
  and memory are back within stated bounds;
- as process 1 on channels of its own (it holds the secret): frames the
  plan does not allow change no result and cost bounded memory, and a flood
  of operations ahead of the victim is capped and named in the error that
  ends the job.
"""

import hashlib
import hmac
import os
import secrets
import socket
import struct
import threading
import time

import pytest
from reports import of_kind, reports
from test_multiprocess import Job

# The TCP transport's own code, whatever the jax: on the newest jax only.
pytestmark = [pytest.mark.multiprocess, pytest.mark.jax_independent]

MAGIC = 0x4A52494E
VERSION = 6
SHM_OFFER_MAGIC = 0x4A52534D
SHM_RING_BYTES = 8 << 20  # shm_link.h, kShmRingBytes
# What the victim may keep after the attacks, beyond what it held before
# (the insider's 4096 kept operations stage 2 KiB each).
EXTRA_THREADS, EXTRA_FDS, EXTRA_RSS_MIB = 16, 16, 128.0
HANDSHAKE_DEADLINE_S = 10.0


def hello(
    process: int, channel: int = 0, nonce: bytes = b"n" * 16, version: int = VERSION
) -> bytes:
    return struct.pack("<IIii", MAGIC, version, process, channel) + nonce


def mac(
    secret: bytes,
    job_id: bytes,
    from_acceptor: bool,
    connector_nonce: bytes,
    acceptor_nonce: bytes,
    connector: int,
    acceptor: int,
    channel: int,
) -> bytes:
    label = (b"jaxring accept" if from_acceptor else b"jaxring connect").ljust(16, b"\0")
    msg = (
        label
        + struct.pack("<I", VERSION)
        + job_id
        + connector_nonce
        + acceptor_nonce
        + struct.pack("<iii", connector, acceptor, channel)
    )
    return hmac.new(secret, msg, hashlib.sha256).digest()


def frame_header(kind: int, **fields) -> bytes:
    """A FrameHeader (native order, 120 bytes) with the given fields."""
    f = dict(
        run_id=1,
        op_id=0,
        group=0,
        ring=0,
        dst_rank=0,
        src_rank=1,
        elem_type=2,
        reduce_op=0,
        world_size=2,
        num_rings=1,
        phase=0,
        algorithm=0,
        shape_digest=0,
        count=8192,
        chunk_bytes=1 << 20,
        topology=0,
        unit=0,
        payload_bytes=0,
        slot_id=0,
    )
    unknown = set(fields) - set(f)
    assert not unknown, f"FrameHeader has no field {unknown}"
    f.update(fields)
    return struct.pack(
        "=IIqqqiiiiiiiiiiqqqqqq",
        MAGIC,
        kind,
        f["run_id"],
        f["op_id"],
        f["group"],
        f["ring"],
        f["dst_rank"],
        f["src_rank"],
        f["elem_type"],
        f["reduce_op"],
        f["world_size"],
        f["num_rings"],
        f["phase"],
        f["algorithm"],
        f["shape_digest"],
        f["count"],
        f["chunk_bytes"],
        f["topology"],
        f["unit"],
        f["payload_bytes"],
        f["slot_id"],
    )


def shm_offer(name: bytes = b"", capacity: int = SHM_RING_BYTES) -> bytes:
    """The ShmOffer a connector sends after its proof (shm_link.h); an
    empty name offers nothing."""
    return struct.pack("=IIQ", SHM_OFFER_MAGIC, len(name), capacity) + name.ljust(96, b"\0")


def connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host.strip("[]"), int(port)), timeout=5)


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the victim closed the connection within `seconds` (what it
    sent before closing is read and dropped)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        sock.settimeout(max(0.05, deadline - time.monotonic()))
        try:
            if not sock.recv(4096):
                return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False
    return False


def send_quietly(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError:
        pass  # the victim may close before everything is written


def prove(
    address: str,
    secret: bytes,
    job_id: bytes,
    process: int = 1,
    channel: int = 9,
    garble: bool = False,
    offer: bytes = shm_offer(),
) -> socket.socket:
    s = connect(address)
    nonce = secrets.token_bytes(16)
    s.sendall(hello(process, channel, nonce))
    reply = b""
    while len(reply) < 64:
        chunk = s.recv(64 - len(reply))
        assert chunk, "the victim closed before its reply"
        reply += chunk
    proof = mac(secret, job_id, False, nonce, reply[16:32], process, 0, channel)
    if garble:
        proof = bytes([proof[0] ^ 1]) + proof[1:]
    s.sendall(proof + offer)
    return s


def offer_answer(s: socket.socket) -> int:
    """The victim's answer to a shared-memory offer (1: mapped)."""
    answer = b""
    while len(answer) < 4:
        chunk = s.recv(4 - len(answer))
        assert chunk, "the victim closed instead of answering the offer"
        answer += chunk
    return struct.unpack("=I", answer)[0]


def attacks(address: str, secret: bytes):
    """(name, function returning whether the victim turned it away)."""
    other_job = secrets.token_bytes(16)

    def one(data: bytes, within: float = 5.0):
        def run():
            with connect(address) as s:
                send_quietly(s, data)
                return closed_within(s, within)

        return run

    def with_proof(key: bytes, job_id: bytes, garble: bool = False):
        def run():
            with prove(address, key, job_id, garble=garble) as s:
                return closed_within(s, 5.0)

        return run

    def truncated():
        with connect(address) as s:
            s.sendall(hello(1)[:10])
            s.shutdown(socket.SHUT_WR)
            return closed_within(s, 5.0)

    def trickle():
        with connect(address) as s:
            started = time.monotonic()
            for byte in hello(1):
                send_quietly(s, bytes([byte]))
                if closed_within(s, 1.0):
                    return time.monotonic() - started < HANDSHAKE_DEADLINE_S + 5
            return False

    def idle_300():
        socks = [connect(address) for _ in range(300)]
        try:
            return all(closed_within(s, HANDSHAKE_DEADLINE_S + 5) for s in socks)
        finally:
            for s in socks:
                s.close()

    def aborts_200():
        with connect(address) as s:
            for _ in range(200):
                key = secrets.randbits(40)
                send_quietly(
                    s,
                    frame_header(2, run_id=key, op_id=key, payload_bytes=1 << 20)
                    + b"x" * (1 << 20),
                )
            return closed_within(s, 5.0)

    return [
        ("garbage bytes", one(os.urandom(256))),
        ("hello, then no proof", one(hello(1) + b"\0" * 32)),
        ("hello with a wrong secret", with_proof(secrets.token_bytes(32), b"j" * 16)),
        ("proof with one bit flipped", with_proof(secret, b"j" * 16, garble=True)),
        ("hello for nonexistent process 5", one(hello(5))),
        ("replayed hello from another job", with_proof(secret, other_job)),
        ("hello of protocol version 2", one(hello(1, version=2))),
        (
            "data frames for upcoming run ids",
            one(
                b"".join(
                    frame_header(1, run_id=r, payload_bytes=32768) + b"\0" * 32768
                    for r in range(1, 5)
                )
            ),
        ),
        ("duplicate units", one(2 * (frame_header(1, payload_bytes=4) + b"\0" * 4))),
        (
            "huge and negative counts, sizes, types",
            one(
                frame_header(1, count=-1, payload_bytes=1 << 40, elem_type=99)
                + frame_header(1, count=1 << 62, payload_bytes=-5, world_size=-3)
            ),
        ),
        ("truncated header", truncated),
        ("trickles a byte a second", trickle),
        ("300 idle connections", idle_300),
        ("200 abort frames for random keys", aborts_200),
        ("forged peer-lost notice", one(frame_header(3, group=1, payload_bytes=7) + b"spoofed")),
    ]


def insider_attacks(address: str, secret: bytes, job_id: bytes, kept: list):
    """A process of the job (it holds the secret) that misbehaves on
    channels of its own; each connection stays open until the job ends,
    since an authenticated connection that closes means its process left."""

    def member(channel: int, offer: bytes = shm_offer()) -> socket.socket:
        s = prove(address, secret, job_id, process=1, channel=channel, offer=offer)
        kept.append(s)
        return s

    def offers_another_links_segment():
        # A segment name of another job, another direction and a path: each
        # is declined (answer 0) and the connection stays.
        names = [
            b"/jaxring-" + b"0" * 32 + b"-1-0-25-" + b"a" * 32,
            b"/jaxring-" + job_id.hex().encode() + b"-0-1-25-" + b"a" * 32,
            b"/../../etc/passwd",
        ]
        return all(
            offer_answer(member(25 + i, shm_offer(name))) == 0 for i, name in enumerate(names)
        )

    def offers_a_segment_others_may_open():
        # Named as the link's own, but readable by everyone: declined.
        name = f"jaxring-{job_id.hex()}-1-0-28-{secrets.token_hex(16)}"
        path = os.path.join("/dev/shm", name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
        try:
            os.fchmod(fd, 0o644)
            os.ftruncate(fd, 4096 + SHM_RING_BYTES)
            return offer_answer(member(28, shm_offer(b"/" + name.encode()))) == 0
        finally:
            os.close(fd)
            os.unlink(path)

    def duplicate_units():
        s = member(21)
        frame = (
            frame_header(1, run_id=2 * 10**9, count=1024, chunk_bytes=4096, payload_bytes=2048)
            + b"\0" * 2048
        )
        send_quietly(s, frame + frame)
        return not closed_within(s, 1.0)

    def abort_flood():
        # 200 aborts with 1 MiB messages for random keys: each keeps 4 KiB.
        s = member(22)
        for _ in range(200):
            key = secrets.randbits(40)
            send_quietly(
                s,
                frame_header(2, run_id=3 * 10**9 + key, op_id=key, payload_bytes=1 << 20)
                + b"x" * (1 << 20),
            )
        return not closed_within(s, 1.0)

    def peer_lost_about_no_one():
        # Process 1 reporting itself, process 0 (the victim), and process 7
        # (the job has two) lost: all ignored.
        s = member(23)
        for lost in (1, 0, 7):
            send_quietly(s, frame_header(3, group=lost, payload_bytes=7) + b"spoofed")
        return not closed_within(s, 1.0)

    def implausible_header():
        # Values this build never sends: the connection goes, quietly (no
        # process is declared lost for it).
        s = member(24)
        kept.remove(s)
        send_quietly(s, frame_header(1, count=-1, elem_type=99, payload_bytes=1 << 40))
        return closed_within(s, 5.0)

    def algorithms_that_never_cross_processes():
        # "direct" (1) reads peers' memory and "nccl" (2) is CUDA's: a data
        # frame naming either, or an unknown one, is never sent by this
        # build.
        closed = []
        for i, fields in enumerate([dict(algorithm=1), dict(algorithm=2), dict(algorithm=99)]):
            s = member(29 + i)
            kept.remove(s)
            send_quietly(
                s,
                frame_header(
                    1,
                    run_id=4 * 10**9 + i,
                    count=1024,
                    chunk_bytes=4096,
                    payload_bytes=2048,
                    **fields,
                )
                + b"\0" * 2048,
            )
            closed.append(closed_within(s, 5.0))
        return all(closed)

    return [
        ("the same unit twice", duplicate_units),
        ("200 aborts of 1 MiB for random keys", abort_flood),
        ("peer-lost notices about no other process", peer_lost_about_no_one),
        ("a header with values never sent", implausible_header),
        (
            "data frames of algorithms that never cross processes",
            algorithms_that_never_cross_processes,
        ),
        ("shared-memory offers of segments not of its link", offers_another_links_segment),
        ("a shared-memory offer of a segment others may open", offers_a_segment_others_may_open),
    ]


def job_output(job) -> str:
    return "\n".join(f"[{r}] {line}" for r in job.lines for line in job.lines[r])


def said(job, rank: int, kind: str) -> dict:
    """The first report of a kind that a process of the job gave."""
    found = of_kind(reports(job.lines[rank]), kind)
    assert found, job_output(job)[-3000:]
    return found[0]


def run_against_job(make_attacks, concurrent=()):
    """Starts the job, runs the attacks against process 0, stops the job.
    Returns the attacks' results and what each process printed."""
    job = Job(2, 600.0, script="hostile_target.py")
    kept = []
    try:
        job.wait_ready(timeout=180)
        ready = said(job, 0, "ready")
        address = ready["address"]
        job_id = bytes.fromhex(ready["job_id"])
        results = {}
        runners = []
        for name, run in make_attacks(address, bytes.fromhex(job.secret), job_id, kept):

            def go(name=name, run=run):
                started = time.monotonic()
                try:
                    results[name] = (bool(run()), None)
                except Exception as e:  # the attack itself failed
                    results[name] = (False, repr(e))
                results[name] += (time.monotonic() - started,)

            t = threading.Thread(target=go)
            t.start()
            runners.append(t)
            if name not in concurrent:
                t.join()  # the slow ones run beside the others
        for t in runners:
            t.join()
        # Every handshake has met its deadline by now: the victim holds
        # nothing more for the strangers.
        time.sleep(2.0)
        open(os.path.join(job.cwd.name, "stop"), "w").close()
        deadline = time.monotonic() + 120
        while not all(of_kind(reports(job.lines[r]), "done") for r in range(2)):
            assert time.monotonic() < deadline, job.lines
            assert all(p.poll() in (None, 0) for p in job.procs), job_output(job)
            time.sleep(0.1)
        for s in kept:  # the job is done: an insider may leave now
            s.close()
        for p in job.procs:
            assert p.wait(timeout=60) == 0, job.lines
        reported = {
            r: {kind: said(job, r, kind) for kind in ("ready", "after", "done")} for r in range(2)
        }
    finally:
        for s in kept:
            s.close()
        job.kill_all()
    table = ["| attack | result | took | error |", "|---|---|---|---|"]
    for name, (ok, err, took) in results.items():
        table.append(f"| {name} | {'held' if ok else 'FAILED'} | {took:.1f} s | {err or ''} |")
    print("\n".join(table))
    for r in range(2):
        print(
            f"process {r}: {reported[r]['ready']} / {reported[r]['after']} / {reported[r]['done']}"
        )
    assert all(ok for ok, _, _ in results.values()), table
    for r in range(2):
        done, after = reported[r]["done"], reported[r]["after"]
        assert done["wrong"] == 0, (r, reported[r])
        assert done["steps"] > 3, reported[r]
        assert after["lost"] == [], (r, after)
        # The two processes share this host: their data went through
        # shared memory while the attacks ran.
        assert after["shm_links"] > 0, (r, after)
    before0, after0 = reported[0]["ready"], reported[0]["after"]
    assert after0["threads"] <= before0["threads"] + EXTRA_THREADS, reported[0]
    assert after0["fds"] <= before0["fds"] + EXTRA_FDS, reported[0]
    assert after0["rss_mib"] <= before0["rss_mib"] + EXTRA_RSS_MIB, reported[0]
    return results, reported


def test_strangers_are_turned_away_and_the_job_stays_exact():
    results, reported = run_against_job(
        lambda address, secret, job_id, kept: attacks(address, secret),
        concurrent=("trickles a byte a second", "300 idle connections"),
    )
    # One refusal per connection: 300 idle ones, one for each other attack.
    assert reported[0]["after"]["refused"] == len(results) - 1 + 300, reported[0]


def test_a_member_that_misbehaves_cannot_change_results_or_exhaust_the_victim():
    results, reported = run_against_job(insider_attacks)
    # Authenticated: nothing was refused at the door.
    assert reported[0]["after"]["refused"] == 0, reported[0]


def test_a_member_flooding_unstarted_operations_is_capped_and_named():
    """Frames for 5000 operations the victim never starts: it keeps 4096,
    refuses the rest and tells the sender. The job's own next operation is
    refused too (a member that floods has broken the job), so every process
    ends with a clear error instead of growing without bound."""
    job = Job(2, 600.0, script="hostile_target.py")
    kept = []
    try:
        job.wait_ready(timeout=180)
        ready = said(job, 0, "ready")
        s = prove(
            ready["address"],
            bytes.fromhex(job.secret),
            bytes.fromhex(ready["job_id"]),
            process=1,
            channel=20,
        )
        kept.append(s)
        for k in range(5000):
            send_quietly(
                s,
                frame_header(1, run_id=10**9 + k, count=1024, chunk_bytes=4096, payload_bytes=2048)
                + b"\0" * 2048,
            )
        for p in job.procs:
            assert p.wait(timeout=120) == 3, job_output(job)
        failed = {r: said(job, r, "failed") for r in range(2)}
        print(job_output(job))
        assert any("refuses more" in failed[r]["message"] for r in range(2)), job_output(job)
        assert failed[0]["pending"] <= 4096 + 8, failed[0]
        assert failed[0]["rss_mib"] <= ready["rss_mib"] + EXTRA_RSS_MIB, failed[0]
    finally:
        for s in kept:
            s.close()
        job.kill_all()
