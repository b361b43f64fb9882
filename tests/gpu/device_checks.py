"""The GPU checks as one prepared run, for a machine with one GPU and no
network: a GPU run is rare and short, so every step has a time limit inside
one overall budget, and whatever happens, the evidence is kept.

    python tests/gpu/device_checks.py LOG_DIR [--budget S] [--only STEP ...]
    python tests/gpu/device_checks.py LOG_DIR --selftest   # no GPU needed

(`bash tests/gpu/run_device_checks.sh LOG_DIR` runs the first.)

The steps run in order, cheap and telling ones first (see `gpu_steps`).
Each runs in a process group of its own with PYTHONFAULTHANDLER=1, writing
to its own log file, never to a pipe. A step still running at its limit,
or when the budget runs out, gets SIGABRT (every Python process in it dumps
all its threads' stacks into its log) and SIGKILL 5 s later. A step whose
limit would not fit in what is left of the budget is skipped, as is one
whose prerequisite did not pass.

LOG_DIR receives at most three files, so that all of them come back from a
machine that returns only a few:

* ``summary.txt``, written as the run goes: one line per step (PASS, FAIL
  with the exit status, TIMEOUT, SKIPPED and why), with the last lines of
  each failed step's log, and the time used;
* ``build.log``, the build's whole output;
* ``logs.tar.gz``, every step's log and one log per rank of every
  multi-process job (repacked after each step).

Exits 0 when every step that ran passed and none was skipped for time.
"""

import argparse
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

# The tail of a failed step's log that goes into the summary.
TAIL_LINES = 30
# The tail of a diagnosis's log that goes into the summary.
DIAGNOSIS_LINES = 150
# The tail of each rank's log written during a failed step.
RANK_TAIL_LINES = 12
# Between SIGABRT and SIGKILL: time for the fault handlers to write stacks.
ABORT_GRACE_S = 5


@dataclasses.dataclass
class Step:
    name: str
    argv: list
    limit_s: float  # the step's own time limit
    needs: tuple = ()  # steps that must have passed first
    env: dict = dataclasses.field(default_factory=dict)
    cwd: str = "/tmp"  # outside the checkout: the installed package is imported
    log_name: str = ""  # default: NN-name.log in the work folder
    # A diagnosis: runs only when this step did not pass, and its whole
    # output goes into the summary; its own status does not count.
    diagnoses: str = ""


@dataclasses.dataclass
class Outcome:
    status: str  # PASS, FAIL, TIMEOUT or SKIPPED
    detail: str = ""
    took_s: float = 0.0


def _tail(path: str, lines: int = TAIL_LINES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError as e:
        return f"(no log: {e})"
    return "\n".join(text.splitlines()[-lines:])


def _indented(text: str) -> str:
    # Lines cut at 300 characters: a rank printing one huge line must not
    # bury the rest.
    return "\n".join("    | " + line[:300] for line in text.splitlines())


class Runner:
    """Runs steps inside one budget and keeps their evidence in log_dir."""

    def __init__(self, log_dir: str, budget_s: float, work_dir: str | None = None):
        self.log_dir = log_dir
        os.makedirs(log_dir, exist_ok=True)
        # Logs are written here and packed into log_dir, so that log_dir
        # holds three files however many logs there are.
        self.work = work_dir or tempfile.mkdtemp(prefix="jaxring-device-checks-")
        os.makedirs(os.path.join(self.work, "ranks"), exist_ok=True)
        self.start = time.monotonic()
        self.deadline = self.start + budget_s
        self.budget_s = budget_s
        self.outcomes: dict[str, Outcome] = {}
        self.diagnoses: set[str] = set()  # diagnosis steps that ran
        self.summary = os.path.join(log_dir, "summary.txt")
        with open(self.summary, "w") as f:
            f.write(f"jaxring device checks: budget {budget_s:.0f} s\n")

    def note(self, text: str) -> None:
        """A line into the summary (and onto stdout), kept at once."""
        print(text, flush=True)
        with open(self.summary, "a") as f:
            f.write(text + "\n")

    def env_for(self, step: Step) -> dict:
        env = dict(os.environ)
        env.update(
            PYTHONUNBUFFERED="1",
            PYTHONFAULTHANDLER="1",
            JAXRING_GPU_LOGS=os.path.join(self.work, "ranks"),
        )
        env.update(step.env)
        return env

    def run(self, step: Step, index: int) -> Outcome:
        missing = [n for n in step.needs if self.outcomes.get(n, Outcome("")).status != "PASS"]
        left = self.deadline - time.monotonic()
        if step.diagnoses:
            if self.outcomes.get(step.diagnoses, Outcome("")).status not in ("FAIL", "TIMEOUT"):
                return Outcome("SKIPPED")  # nothing to diagnose: not even a line
            self.diagnoses.add(step.name)
        if missing:
            out = Outcome("SKIPPED", f"needs {', '.join(missing)}")
        elif left < min(step.limit_s, 20) + ABORT_GRACE_S:
            out = Outcome("SKIPPED", f"budget spent ({left:.0f} s left)")
        else:
            before = self._rank_logs()
            out = self._execute(step, index, min(step.limit_s, left - ABORT_GRACE_S))
        self.outcomes[step.name] = out
        line = f"{out.status:<7} {step.name:<16} {out.took_s:6.1f} s  {out.detail}"
        self.note(line.rstrip())
        if step.diagnoses and out.status != "SKIPPED":
            self.note(_indented(_tail(self._log(step, index), DIAGNOSIS_LINES)))
        elif out.status in ("FAIL", "TIMEOUT"):
            self.note(_indented(_tail(self._log(step, index))))
            # The ranks of the step's jobs: where each one stopped.
            for path, stamp in sorted(self._rank_logs().items()):
                if before.get(path) != stamp:
                    self.note(
                        f"    {os.path.basename(path)}:\n" + _indented(_tail(path, RANK_TAIL_LINES))
                    )
        self.pack()
        return out

    def _rank_logs(self) -> dict:
        """path -> (size, mtime) of every rank log so far."""
        ranks = os.path.join(self.work, "ranks")
        stamps = {}
        for name in os.listdir(ranks):
            st = os.stat(os.path.join(ranks, name))
            stamps[os.path.join(ranks, name)] = (st.st_size, st.st_mtime_ns)
        return stamps

    def _log(self, step: Step, index: int) -> str:
        if step.log_name:
            return os.path.join(self.log_dir, step.log_name)
        return os.path.join(self.work, f"{index:02d}-{step.name}.log")

    def _execute(self, step: Step, index: int, limit_s: float) -> Outcome:
        t0 = time.monotonic()
        path = self._log(step, index)
        with open(path, "w") as log:
            log.write(f"$ {' '.join(step.argv)}\n(limit {limit_s:.0f} s)\n")
            log.flush()
            # A group of its own: SIGABRT reaches every process the step
            # started (pytest, the ranks of a job, a compiler).
            proc = subprocess.Popen(
                step.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=step.cwd,
                env=self.env_for(step),
                start_new_session=True,
            )
        try:
            rc = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            self._stop(proc)
            return Outcome(
                "TIMEOUT",
                f"still running after {limit_s:.0f} s: stopped with SIGABRT (stacks in its log)",
                time.monotonic() - t0,
            )
        took = time.monotonic() - t0
        # The group may outlive its leader (a rank left behind).
        self._stop(proc, quiet=True)
        if rc == 0:
            return Outcome("PASS", "", took)
        return Outcome("FAIL", f"exit status {rc}", took)

    @staticmethod
    def _stop(proc: subprocess.Popen, quiet: bool = False) -> None:
        def signal_group(sig):
            try:
                os.killpg(proc.pid, sig)
                return True
            except (ProcessLookupError, PermissionError):
                return False

        if not signal_group(signal.SIGKILL if quiet else signal.SIGABRT) or quiet:
            proc.wait()
            return
        try:
            proc.wait(timeout=ABORT_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        # The leader may have ended while others in the group still dump.
        time.sleep(0.5)
        signal_group(signal.SIGKILL)
        proc.wait()

    def pack(self) -> None:
        """Every log so far, into log_dir/logs.tar.gz (replaced whole)."""
        tmp = os.path.join(self.log_dir, ".logs.tar.gz.part")
        with tarfile.open(tmp, "w:gz") as tar:
            tar.add(self.work, arcname="logs")
        os.replace(tmp, os.path.join(self.log_dir, "logs.tar.gz"))

    def finish(self) -> int:
        used = time.monotonic() - self.start
        counts = {}
        for o in self.outcomes.values():
            counts[o.status] = counts.get(o.status, 0) + 1
        self.note(
            f"done in {used:.0f} s of {self.budget_s:.0f}: "
            + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
        )
        self.pack()
        bad = [
            n
            for n, o in self.outcomes.items()
            if n not in self.diagnoses
            and o.status in ("FAIL", "TIMEOUT")
            or (o.status == "SKIPPED" and o.detail.startswith("budget"))
        ]
        return 1 if bad else 0


def _py(*args) -> list:
    return [sys.executable, *args]


def _pytest(*tests) -> list:
    paths = [os.path.join(REPO, t) for t in tests]
    return _py("-m", "pytest", "-x", "-q", "-rA", "-s", "-p", "no:cacheprovider", *paths)


def _build_command() -> list:
    """pip install of the checkout with the CUDA backend, for sm_90 only,
    in a build folder that a second run on the same machine reuses; with
    debug information, so that a crash's native stack names jaxring's
    functions."""
    script = f"""
set -e
# nvcc where CUDA images put it, when it is not on PATH.
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
tcp_auth=ON
if [ ! -f /usr/include/openssl/hmac.h ]; then
  echo "no OpenSSL headers: JAXRING_TCP_AUTH=OFF (the GPU checks do not use TCP)"
  tcp_auth=OFF
fi
cd {REPO}
JAXRING_CUDA=ON JAXRING_TCP_AUTH=$tcp_auth CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \\
  {sys.executable} -m pip install -v --no-build-isolation --no-deps \\
  --config-settings=build-dir=/tmp/jaxring-build \\
  --config-settings=cmake.build-type=RelWithDebInfo \\
  --config-settings=cmake.define.CMAKE_CUDA_ARCHITECTURES=90 .
"""
    return ["bash", "-c", script]


def gpu_steps() -> list[Step]:
    gpu_test = "tests/gpu/test_gpu.py::"
    # NCCL's account of communicator set-up and transports, for the first
    # multi-process job: the reason, if it fails there.
    nccl_info = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"}
    bench = os.path.join(REPO, "benchmarks", "gpu_allreduce.py")
    built = ("build",)
    return [
        Step("probe", _py(os.path.join(HERE, "probe.py")), 90),
        Step("build", _build_command(), 300, needs=("probe",), log_name="build.log"),
        Step("link", _py(os.path.join(HERE, "probe.py"), "--built"), 60, needs=built),
        Step(
            "lowering",
            _pytest("tests/test_cuda_backend.py"),
            120,
            needs=("link",),
            env={"JAX_PLATFORMS": "cpu", "JAXRING_REQUIRE_CUDA_BUILD": "1"},
        ),
        Step(
            "kernel",
            _pytest(gpu_test + "test_reduce_kernel_matches_cpu_bitwise"),
            90,
            needs=("link",),
        ),
        Step("world1", _pytest(gpu_test + "test_world_of_one_gpu"), 120, needs=("link",)),
        Step(
            "world1_diagnosis",
            _py(os.path.join(HERE, "diagnose_world_of_one.py")),
            240,
            needs=("link",),
            diagnoses="world1",
        ),
        Step(
            "world2",
            _pytest(gpu_test + "test_processes_sharing_the_gpu_match_numpy[2]"),
            150,
            needs=("link",),
            env=nccl_info,
        ),
        Step(
            "overlap",
            _pytest(gpu_test + "test_overlap_step_matches_pmean_at_the_end"),
            120,
            needs=("link",),
        ),
        Step(
            "peer_missing",
            _pytest(gpu_test + "test_missing_peer_times_out_then_fails_fast"),
            90,
            needs=("link",),
        ),
        Step(
            "peer_dies",
            _pytest(gpu_test + "test_peer_dying_mid_job_raises_instead_of_hanging"),
            90,
            needs=("link",),
        ),
        Step("kernel_bw", _py(bench, "--parts", "kernel"), 60, needs=("kernel",)),
        Step("busbw", _py(bench, "--parts", "busbw", "--worlds", "2"), 150, needs=("link",)),
        Step(
            "world4",
            _pytest(gpu_test + "test_processes_sharing_the_gpu_match_numpy[4]"),
            150,
            needs=("link",),
        ),
        Step("overlap_bench", _py(bench, "--parts", "overlap"), 120, needs=("overlap",)),
        Step("busbw_sweep", _py(bench, "--parts", "sweep"), 150, needs=("busbw",)),
    ]


def selftest_steps() -> list[Step]:
    """Stand-ins for the GPU steps that need no GPU: jobs of two ranks in
    which one rank hangs, prints a mebibyte, or dies (gpu_worker's selftest
    modes), to check that the summary names each within the budget."""

    def job(mode, timeout):
        code = (
            f"import sys; sys.path.insert(0, {HERE!r}); import gpu_worker; "
            f"results = gpu_worker.launch(2, {mode!r}, timeout={timeout}); "
            "[print(f'rank {i}: exit {rc}, {len(out)} characters') "
            "for i, (rc, out) in enumerate(results)]; "
            "sys.exit(max(abs(rc) for rc, _ in results))"
        )
        return _py("-c", code)

    return [
        Step("passes", _py("-c", "print('fine')"), 30),
        Step("spews", job("selftest_spew", 60), 60, needs=("passes",)),
        # 15 s: the job and its ranks import jaxring before a rank hangs.
        Step("hangs", job("selftest_hang", 3600), 15, needs=("passes",)),
        Step("dies", job("selftest_die", 60), 60),
        Step("after_death", _py("-c", "print('never')"), 30, needs=("dies",)),
        Step("why_it_died", _py("-c", "print('a diagnosis of the death')"), 30, diagnoses="dies"),
        Step("why_it_passed", _py("-c", "print('never')"), 30, diagnoses="passes"),
        Step("outlasts_budget", _py("-c", "import time; time.sleep(3600)"), 3600),
        Step("no_time_left", _py("-c", "print('never')"), 30),
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log_dir")
    parser.add_argument(
        "--budget", type=float, default=450, help="seconds for the whole run (default 450)"
    )
    parser.add_argument(
        "--only",
        nargs="+",
        default=None,
        help="run these steps (and nothing else: name their prerequisites too)",
    )
    parser.add_argument(
        "--selftest", action="store_true", help="the runner's own check, with stand-in steps"
    )
    args = parser.parse_args(argv)
    steps = selftest_steps() if args.selftest else gpu_steps()
    if args.only:
        unknown = set(args.only) - {s.name for s in steps}
        if unknown:
            parser.error(f"no step {sorted(unknown)}; steps: {[s.name for s in steps]}")
        steps = [s for s in steps if s.name in args.only]
        for s in steps:
            s.needs = tuple(n for n in s.needs if n in args.only)
    runner = Runner(args.log_dir, args.budget)
    try:
        for i, step in enumerate(steps):
            runner.run(step, i)
    finally:
        rc = runner.finish()
        shutil.rmtree(runner.work, ignore_errors=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
