"""The autotuner's pure part: the model's parameters fitted to measurements,
the choice per message size, and the table that carries both.

``python -m jaxring.tune`` measures; this module fits and chooses. A choice
is (algorithm, rings, chunk_bytes, topology). Its predicted time is

* ring: ``call_s`` plus the cost model's time of the plan
  (``cost_model.flat_ring_time`` for topology ``"flat"``,
  ``cost_model.tiered_time`` for ``"auto"``, the tiers jaxring derives from
  where the ranks run) with each tier's (alpha, beta) and the reduction cost
  gamma. ``call_s`` is the fixed cost of one call (dispatch, joining,
  completion), which on CPU is the largest term below about a megabyte;
* exchange: ``call_s`` plus ``cost_model.exchange_time`` with the same
  parameters: it crosses the same links, in log2(n) steps of the whole
  buffer instead of 2(n-1) of a slice, so it wins where the steps' latency
  outweighs the bytes. Measured across processes only (in one process
  direct takes the small sizes), for world sizes with a factor 2;
* direct: ``direct_call_s + nbytes * direct_s_per_byte``, in one process
  and across the processes of one host that share the host segment.

In one process there is one tier, with ``alpha_s`` and ``beta_s_per_byte``.
Across processes whose ranks form several tiers, ``tiers`` holds each one's
(size, alpha, beta, shared_by), fitted together from flat and tiered
measurements: the flat ring's times pin the loosest tier, the tiered plan's
the rest.

A table holds, per topology key (platform, ranks, processes), the fitted
parameters and the choice for each measured size; an allreduce of n bytes
takes the choice of the smallest listed size >= n (the largest beyond
them). ``jaxring.config.tuning`` says which table is used: ``"auto"`` (the
default) reads the cache file written by ``python -m jaxring.tune``
when it has an entry for the topology, ``"off"`` none, or a path. A
setting given explicitly (argument, ``jaxring.config.update``, environment)
always wins over the table.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import tempfile
import warnings
from collections.abc import Iterable

import numpy as np

from jaxring._src import cost_model

VERSION = 1


@dataclasses.dataclass(frozen=True)
class Candidate:
    """Settings the tuner measures, and what a tuning table keeps for a size
    (choice.tuned_settings applies it)."""

    algorithm: str  # "ring", "exchange" or "direct"
    rings: int
    chunk_bytes: int
    # "flat": one ring over every rank; "auto": the tiered plan over the
    # tiers jaxring derives (a flat ring where it finds one tier).
    topology: str = "flat"


@dataclasses.dataclass(frozen=True)
class Params:
    call_s: float
    alpha_s: float
    beta_s_per_byte: float
    gamma_s_per_byte: float
    direct_call_s: float
    direct_s_per_byte: float
    # Several tiers: (size, alpha_s, beta_s_per_byte, shared_by) of each,
    # tightest first; alpha_s and beta_s_per_byte then repeat the loosest.
    tiers: tuple = ()

    @classmethod
    def from_dict(cls, d: dict) -> Params:
        d = dict(d)
        d["tiers"] = tuple(tuple(t) for t in d.get("tiers", ()))
        return cls(**d)


def candidates(
    world: int,
    in_one_process: bool,
    quick: bool = False,
    tiered: bool = False,
    host_direct: bool = False,
) -> list[Candidate]:
    """The choices the tuner measures: ring counts x chunk sizes (each as a
    flat ring and, with ``tiered``, as the tiered plan), the direct
    algorithm where every rank is in this process or, with
    ``host_direct``, the processes share the host segment (where "auto"
    takes it, however many devices each holds), and the exchange
    where the ranks span processes (and the world size has a factor 2:
    otherwise the exchange is the ring)."""
    rings = (1, 2) if quick else (1, 2, 4)
    chunks = (256 << 10, 1 << 20) if quick else (64 << 10, 256 << 10, 1 << 20, 4 << 20)
    plans = ("flat", "auto") if tiered else ("flat",)
    out = [Candidate("ring", r, c, t) for t, r, c in itertools.product(plans, rings, chunks)]
    if (in_one_process or host_direct) and world > 1:
        out.append(Candidate("direct", 2, 1 << 20))
    if not in_one_process and world % 2 == 0:
        # One ring: its buffers are small where it wins, and more rings
        # would only split them further.
        out.append(Candidate("exchange", 1, 1 << 20))
    return out


def shared_links(dims) -> tuple[int, ...]:
    """Ranks sharing one link on each tier, as the tuner assumes it: every
    rank of a group of the tighter tiers leaves through one link of the
    next (one NIC per host, one connection per pair of processes)."""
    return tuple(math.prod(dims[:i]) for i in range(len(dims)))


def _layout(params: Params, world: int) -> list[tuple[int, int]]:
    """(size, shared_by) of each tier the parameters describe."""
    if params.tiers:
        return [(int(t[0]), int(t[3])) for t in params.tiers]
    return [(world, 1)]


def _plan_time(choice: Candidate):
    """The cost model's function for a ring or exchange choice."""
    if choice.algorithm == "exchange":
        return cost_model.exchange_time
    return cost_model.tiered_time if choice.topology == "auto" else cost_model.flat_ring_time


def _plan_terms(choice: Candidate, layout, nbytes: float, gamma: float):
    """The plan's time (ring or exchange) as a linear function of the
    tiers' parameters: the coefficients of (alpha_0, beta_0, alpha_1,
    beta_1, ...), and the reduction's part."""
    plan = _plan_time(choice)

    def t(values, g):
        tiers = tuple(
            cost_model.Tier(size, values[2 * i], values[2 * i + 1], shared)
            for i, (size, shared) in enumerate(layout)
        )
        m = cost_model.Machine(tiers, g)
        return plan(m, nbytes, choice.rings, choice.chunk_bytes)

    k = 2 * len(layout)
    coefficients = [t([1.0 if j == i else 0.0 for j in range(k)], 0.0) for i in range(k)]
    return coefficients, t([0.0] * k, gamma)


def _tier_values(params: Params) -> list[float]:
    if params.tiers:
        return [v for t in params.tiers for v in (t[1], t[2])]
    return [params.alpha_s, params.beta_s_per_byte]


def predict(params: Params, choice: Candidate, world: int, nbytes: float) -> float:
    if world <= 1:
        return 0.0
    if choice.algorithm == "direct":
        return params.direct_call_s + nbytes * params.direct_s_per_byte
    coefficients, g = _plan_terms(choice, _layout(params, world), nbytes, params.gamma_s_per_byte)
    return params.call_s + g + sum(c * v for c, v in zip(coefficients, _tier_values(params)))


def _nonnegative_fit(rows: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: the best fit over the
    subsets of columns whose unconstrained solution is non-negative."""
    k = rows.shape[1]
    best, best_err = np.zeros(k), float(np.sum(target**2))
    for size in range(1, k + 1):
        for cols in itertools.combinations(range(k), size):
            sol, *_ = np.linalg.lstsq(rows[:, cols], target, rcond=None)
            if (sol < 0).any():
                continue
            err = float(np.sum((rows[:, cols] @ sol - target) ** 2))
            if err < best_err:
                best_err = err
                best = np.zeros(k)
                best[list(cols)] = sol
    return best


def fit(
    measurements: Iterable[tuple[Candidate, float, float]],
    world: int,
    gamma_s_per_byte: float,
    dims: tuple = (),
) -> Params:
    """Parameters from (choice, bytes, seconds) measurements. Relative
    errors are minimised (each row is divided by its time), so small
    messages count as much as large ones. gamma is measured apart: for one
    tier it is not separable from beta in allreduce times.

    ``dims``, the tiers (tightest first) of ranks spread over processes,
    fits an (alpha, beta) per tier, with the link sharing of
    :func:`shared_links`; without it there is one tier of ``world`` ranks."""
    layout = list(zip(dims, shared_links(dims))) if len(dims) > 1 else [(world, 1)]
    plan_rows, plan_t, plan_w, direct_rows, direct_t = [], [], [], [], []
    for choice, nbytes, seconds in measurements:
        if choice.algorithm == "direct":
            direct_rows.append([1.0, nbytes])
            direct_t.append(seconds)
            continue
        coefficients, g = _plan_terms(choice, layout, nbytes, gamma_s_per_byte)
        plan_rows.append([1.0, *coefficients])
        plan_t.append(seconds - g)  # the rest the fit must explain
        plan_w.append(1.0 / max(seconds, 1e-9))
    call, tier_values, d_call, d_byte = 0.0, [0.0] * (2 * len(layout)), 0.0, 0.0
    if plan_rows:
        r, t, w = np.array(plan_rows), np.array(plan_t), np.array(plan_w)
        call, *tier_values = _nonnegative_fit(r * w[:, None], t * w)
    if direct_rows:
        r, t = np.array(direct_rows), np.array(direct_t)
        w = 1.0 / np.maximum(t, 1e-9)
        d_call, d_byte = _nonnegative_fit(r * w[:, None], t * w)
    tiers = ()
    if len(layout) > 1:
        tiers = tuple(
            (size, float(tier_values[2 * i]), float(tier_values[2 * i + 1]), shared)
            for i, (size, shared) in enumerate(layout)
        )
    return Params(
        float(call),
        float(tier_values[-2]),
        float(tier_values[-1]),
        float(gamma_s_per_byte),
        float(d_call),
        float(d_byte),
        tiers,
    )


# Predictions this close to the fastest one count as a tie: the model does
# not tell such candidates apart (ring counts that only change how the same
# bytes are split, for one), so a measurement decides between them.
TIE = 0.03


def select(
    params: Params,
    choices: list[Candidate],
    world: int,
    sizes: Iterable[int],
    measured=None,
    direct_everywhere_or_nowhere: bool = False,
) -> dict[int, Candidate]:
    """The choice the model predicts fastest at each size. Among choices
    predicted within TIE of the fastest, the one measured fastest at that
    size wins, where ``measured`` ((choice, bytes, seconds) rows) has it.

    ``direct_everywhere_or_nowhere`` (processes of one host that share the
    host segment): direct at every size or at none. Direct sends no frames,
    so two processes that reach one call site with different shapes, one
    taking direct and the other the ring, could not tell and would wait
    for each other until the timeout; in one algorithm they fail at once
    with MismatchError, as under "auto". The family kept is the one whose
    choices lose least to the fastest, summed over the sizes as ratios of
    predicted times (direct where they tie)."""
    sizes = list(sizes)
    fastest = _fastest(params, choices, world, sizes, measured)
    if (
        not direct_everywhere_or_nowhere
        or len({c.algorithm == "direct" for c in fastest.values()}) < 2
    ):
        return fastest
    families = (
        [c for c in choices if c.algorithm == "direct"],
        [c for c in choices if c.algorithm != "direct"],
    )

    def loss(picked: dict[int, Candidate]) -> float:
        return sum(
            predict(params, picked[n], world, n) / predict(params, fastest[n], world, n)
            for n in sizes
        )

    return min((_fastest(params, f, world, sizes, measured) for f in families), key=loss)


def _fastest(
    params: Params, choices: list[Candidate], world: int, sizes: list[int], measured
) -> dict[int, Candidate]:
    """select's choice at each size, on its own (no family kept)."""
    times = {(c, n): t for c, n, t in (measured or ())}
    out = {}
    for n in sizes:
        predicted = {c: predict(params, c, world, n) for c in choices}
        fastest = min(predicted.values())
        tied = [c for c in choices if predicted[c] <= fastest * (1 + TIE)]
        out[n] = min(tied, key=lambda c: (times.get((c, n), math.inf), predicted[c]))
    return out


def lookup(entry: dict, nbytes: int) -> Candidate:
    """The choice of the smallest listed size >= nbytes (the largest size's
    beyond them)."""
    sizes = sorted(int(s) for s in entry["choices"])
    size = next((s for s in sizes if s >= nbytes), sizes[-1])
    return Candidate(**entry["choices"][str(size)])


def key(platform: str, world: int, processes: int) -> str:
    return f"{platform}/ranks={world}/processes={processes}"


def cache_path() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxring", "tuning.json")


def entry(params: Params, selection: dict[int, Candidate]) -> dict:
    return {
        "params": dataclasses.asdict(params),
        "choices": {str(n): dataclasses.asdict(c) for n, c in sorted(selection.items())},
    }


def load(path: str) -> dict:
    """The tables of a tuning file ({} for a file that is missing)."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        data = json.load(f)
    if data.get("version") != VERSION or not isinstance(data.get("tables"), dict):
        raise ValueError(
            f"{path}: not a jaxring tuning file of version {VERSION} "
            "(run python -m jaxring.tune again)"
        )
    return data["tables"]


def save(path: str, table_key: str, table_entry: dict) -> None:
    """Adds or replaces one topology's entry, keeping the others."""
    tables = load(path) if os.path.exists(path) else {}
    tables[table_key] = table_entry
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    # A name of its own (every process of a job writes the table, maybe
    # into one file, maybe from containers whose pids repeat).
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"version": VERSION, "tables": tables}, f, indent=1)
        umask = os.umask(0)  # mkstemp makes it 0600; open() would honour the umask
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)  # readers never see half a file
    except BaseException:
        os.unlink(tmp)
        raise


_loaded: dict[str, tuple[float, dict]] = {}


def mixes_direct(table_entry: dict) -> bool:
    """Whether a table's entry takes direct at some sizes and not at others."""
    return len({c["algorithm"] == "direct" for c in table_entry["choices"].values()}) == 2


_warned_mixed: set[tuple[str, str]] = set()


def tuned_choice(
    setting: str, table_key: str, nbytes: int, across_processes: bool = False
) -> Candidate | None:
    """The table's choice for an operation, or None (tuning off, no file,
    no entry for this topology; across processes, an entry that mixes
    direct with the ring by size, which tables written before select()
    kept one family could: it is left unused, with a warning, rather than
    let processes with different shapes wait on each other)."""
    if setting == "off":
        return None
    path = cache_path() if setting == "auto" else setting
    try:
        mtime = os.path.getmtime(path)
    except OSError:
        if setting != "auto":
            raise FileNotFoundError(
                f"jaxring.config.tuning: no tuning file at {path!r} "
                "(write one with python -m jaxring.tune --out PATH)"
            ) from None
        return None
    cached = _loaded.get(path)
    if cached is None or cached[0] != mtime:
        cached = (mtime, load(path))
        _loaded[path] = cached
    table = cached[1].get(table_key)
    if table is None:
        return None
    if across_processes and mixes_direct(table):
        if (path, table_key) not in _warned_mixed:
            _warned_mixed.add((path, table_key))
            warnings.warn(
                f"jaxring: the tuning table in {path} for {table_key} takes direct at "
                "some sizes and the ring at others across processes. Processes that "
                "reach one allreduce with different shapes would then wait for each "
                "other until the timeout instead of failing with MismatchError, so "
                "jaxring does not use it and runs its defaults. Run python -m "
                "jaxring.tune again: it now keeps direct at every size or at none.",
                stacklevel=2,
            )
        return None
    return lookup(table, nbytes)


def relative_error(predicted: float, measured: float) -> float:
    return abs(predicted - measured) / measured if measured > 0 else math.inf
