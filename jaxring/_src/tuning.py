"""The autotuner's pure part: the model's parameters fitted to measurements,
the choice per message size, and the table that carries both.

``python -m jaxring.tune`` measures; this module fits and chooses. A choice
is (algorithm, rings, chunk_bytes). Its predicted time is

* ring: ``call_s + cost_model.flat_ring_time(...)`` with the tier's
  (alpha, beta) and the reduction cost gamma: the cost model plus the fixed
  cost of one call (dispatch, joining, completion), which on CPU is the
  largest term below about a megabyte;
* direct: ``direct_call_s + nbytes * direct_s_per_byte``.

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
from typing import Iterable

import numpy as np

from jaxring._src import cost_model

VERSION = 1


@dataclasses.dataclass(frozen=True)
class Choice:
    algorithm: str       # "ring" or "direct"
    rings: int
    chunk_bytes: int


@dataclasses.dataclass(frozen=True)
class Params:
    call_s: float
    alpha_s: float
    beta_s_per_byte: float
    gamma_s_per_byte: float
    direct_call_s: float
    direct_s_per_byte: float


def candidates(world: int, in_one_process: bool, quick: bool = False) -> list[Choice]:
    """The choices the tuner measures: ring counts x chunk sizes, and the
    direct algorithm where every rank is in this process."""
    rings = (1, 2) if quick else (1, 2, 4)
    chunks = (256 << 10, 1 << 20) if quick else (64 << 10, 256 << 10, 1 << 20, 4 << 20)
    out = [Choice("ring", r, c) for r, c in itertools.product(rings, chunks)]
    if in_one_process and world > 1:
        out.append(Choice("direct", 2, 1 << 20))
    return out


def _ring_terms(choice: Choice, world: int, nbytes: float, gamma: float):
    """(alpha coefficient, beta coefficient, gamma part) of the ring's time."""
    def t(alpha, beta, g):
        m = cost_model.Machine((cost_model.Tier(world, alpha, beta),), g)
        return cost_model.flat_ring_time(m, nbytes, choice.rings, choice.chunk_bytes)
    return t(1.0, 0.0, 0.0), t(0.0, 1.0, 0.0), t(0.0, 0.0, gamma)


def predict(params: Params, choice: Choice, world: int, nbytes: float) -> float:
    if world <= 1:
        return 0.0
    if choice.algorithm == "direct":
        return params.direct_call_s + nbytes * params.direct_s_per_byte
    a, b, g = _ring_terms(choice, world, nbytes, params.gamma_s_per_byte)
    return params.call_s + params.alpha_s * a + params.beta_s_per_byte * b + g


def _nonnegative_fit(rows: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: the best fit over the
    subsets of columns whose unconstrained solution is non-negative."""
    k = rows.shape[1]
    best, best_err = np.zeros(k), float(np.sum(target ** 2))
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


def fit(measurements: Iterable[tuple[Choice, float, float]], world: int,
        gamma_s_per_byte: float) -> Params:
    """Parameters from (choice, bytes, seconds) measurements. Relative
    errors are minimised (each row is divided by its time), so small
    messages count as much as large ones. gamma is measured apart: for one
    tier it is not separable from beta in allreduce times."""
    ring_rows, ring_t, ring_w, direct_rows, direct_t = [], [], [], [], []
    for choice, nbytes, seconds in measurements:
        if choice.algorithm == "direct":
            direct_rows.append([1.0, nbytes])
            direct_t.append(seconds)
            continue
        a, b, g = _ring_terms(choice, world, nbytes, gamma_s_per_byte)
        ring_rows.append([1.0, a, b])
        ring_t.append(seconds - g)  # the rest the fit must explain
        ring_w.append(1.0 / max(seconds, 1e-9))
    call = alpha = beta = d_call = d_byte = 0.0
    if ring_rows:
        r, t, w = np.array(ring_rows), np.array(ring_t), np.array(ring_w)
        call, alpha, beta = _nonnegative_fit(r * w[:, None], t * w)
    if direct_rows:
        r, t = np.array(direct_rows), np.array(direct_t)
        w = 1.0 / np.maximum(t, 1e-9)
        d_call, d_byte = _nonnegative_fit(r * w[:, None], t * w)
    return Params(float(call), float(alpha), float(beta), float(gamma_s_per_byte),
                  float(d_call), float(d_byte))


def select(params: Params, choices: list[Choice], world: int,
           sizes: Iterable[int]) -> dict[int, Choice]:
    """The choice the model predicts fastest at each size."""
    return {n: min(choices, key=lambda c: predict(params, c, world, n)) for n in sizes}


def lookup(entry: dict, nbytes: int) -> Choice:
    """The choice of the smallest listed size >= nbytes (the largest size's
    beyond them)."""
    sizes = sorted(int(s) for s in entry["choices"])
    size = next((s for s in sizes if s >= nbytes), sizes[-1])
    return Choice(**entry["choices"][str(size)])


def key(platform: str, world: int, processes: int) -> str:
    return f"{platform}/ranks={world}/processes={processes}"


def cache_path() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxring", "tuning.json")


def entry(params: Params, selection: dict[int, Choice]) -> dict:
    return {"params": dataclasses.asdict(params),
            "choices": {str(n): dataclasses.asdict(c) for n, c in sorted(selection.items())}}


def load(path: str) -> dict:
    """The tables of a tuning file ({} for a file that is missing)."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        data = json.load(f)
    if data.get("version") != VERSION or not isinstance(data.get("tables"), dict):
        raise ValueError(f"{path}: not a jaxring tuning file of version {VERSION} "
                         "(run python -m jaxring.tune again)")
    return data["tables"]


def save(path: str, table_key: str, table_entry: dict) -> None:
    """Adds or replaces one topology's entry, keeping the others."""
    tables = load(path) if os.path.exists(path) else {}
    tables[table_key] = table_entry
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"version": VERSION, "tables": tables}, f, indent=1)
    os.replace(tmp, path)  # readers never see half a file


_loaded: dict[str, tuple[float, dict]] = {}


def tuned_choice(setting: str, table_key: str, nbytes: int) -> Choice | None:
    """The table's choice for an operation, or None (tuning off, no file,
    no entry for this topology)."""
    if setting == "off":
        return None
    path = cache_path() if setting == "auto" else setting
    try:
        mtime = os.path.getmtime(path)
    except OSError:
        if setting != "auto":
            raise FileNotFoundError(
                f"jaxring.config.tuning: no tuning file at {path!r} "
                "(write one with python -m jaxring.tune --out PATH)") from None
        return None
    cached = _loaded.get(path)
    if cached is None or cached[0] != mtime:
        cached = (mtime, load(path))
        _loaded[path] = cached
    table = cached[1].get(table_key)
    return None if table is None else lookup(table, nbytes)


def relative_error(predicted: float, measured: float) -> float:
    return abs(predicted - measured) / measured if measured > 0 else math.inf
