"""jaxring's settings: defaults, environment variables, per-call overrides.

Every setting has a default, can be set for the process with a ``JAXRING_*``
environment variable (read once, at import), and changed later with
``jaxring.config.update(name, value)``. Settings are read at trace time, so a
change applies to functions traced after it.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from typing import Any

from jaxring._src import topology as _topology


@dataclasses.dataclass(frozen=True)
class _Option:
    name: str
    env: str
    default: Any
    parse: Callable[[str], Any]
    check: Callable[[Any], bool]
    requirement: str
    doc: str


# Upper bounds of the numeric settings, checked here with a clear message and
# again by the C++ handlers (xla_ffi/ffi_common.h), which hold them in
# narrower types: a ring count beyond an int, a timeout past a deadline's
# range, a chunk larger than any buffer.
MAX_RINGS = 64
MAX_CHUNK_BYTES = 1 << 40
MAX_TIMEOUT_S = 7 * 24 * 3600.0
# An emulated link slower than a byte a second, or later than a minute,
# models no network: it would only stall the job.
MIN_LINK_BYTES_PER_S = 1.0
MAX_LINK_LATENCY_S = 60.0


def _int_in(lo: int, hi: int) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _number_in(hi: float) -> Callable[[Any], bool]:
    """A finite number in (0, hi]."""
    return lambda v: (
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and 0 < v <= hi
    )


# Bits are spelled out ("Gbit"); bytes are a capital B ("GB"). "Gb" is
# refused rather than guessed.
_RATE_UNITS = {
    "bit": 1 / 8,
    "Kbit": 1e3 / 8,
    "Mbit": 1e6 / 8,
    "Gbit": 1e9 / 8,
    "Tbit": 1e12 / 8,
    "B": 1.0,
    "KB": 1e3,
    "MB": 1e6,
    "GB": 1e9,
    "TB": 1e12,
}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def _number_with_unit(text: str, units: dict) -> float:
    t = text.strip()
    for unit in sorted(units, key=len, reverse=True):
        if t.endswith(unit) or (unit.endswith("bit") and t.lower().endswith(unit.lower())):
            value = float(t[: -len(unit)])
            if not math.isfinite(value) or value < 0:
                raise ValueError(text)
            return value * units[unit]
    raise ValueError(text)


def parse_link(spec: str) -> tuple[float, float]:
    """``"10Gbit,20us"`` -> (bytes per second, latency in seconds).

    Bandwidth units: bit, Kbit, Mbit, Gbit, Tbit (bits per second, any case)
    or B, KB, MB, GB, TB (bytes per second, powers of 1000; capital B).
    Latency units: s, ms, us, ns; the latency may be omitted (``"10Gbit"``).
    """
    parts = [p for p in spec.split(",")]
    if not 1 <= len(parts) <= 2:
        raise ValueError(spec)
    rate = _number_with_unit(parts[0], _RATE_UNITS)
    latency = _number_with_unit(parts[1], _TIME_UNITS) if len(parts) == 2 else 0.0
    if not (MIN_LINK_BYTES_PER_S <= rate < math.inf and latency <= MAX_LINK_LATENCY_S):
        raise ValueError(spec)
    return rate, latency


def parse_links(spec: str) -> tuple[tuple[int, float, float], ...]:
    """One emulated link, or one per tier of an emulated cluster, as
    ``(size, bytes per second, latency in seconds)`` per tier, tightest
    first.

    ``"10Gbit,20us"`` is one link for every device: ``((0, 1.25e9, 2e-5),)``.
    ``"4:100Gbit,2us;1Gbit,20us"`` is groups of 4 ranks joined by 100 Gbit
    links, and those groups (hosts) joined by 1 Gbit links; every tier but
    the last names its size, and the last takes the rest of the ranks (size
    0 here). Up to 4 tiers.
    """
    parts = spec.split(";")
    if not 1 <= len(parts) <= 4:
        raise ValueError(spec)
    tiers = []
    for i, part in enumerate(parts):
        size, sep, link = part.partition(":")
        if (i + 1 < len(parts)) != bool(sep):
            raise ValueError(spec)  # a size on every tier but the last
        n = 0
        if sep:
            digits = size.strip()
            if not (digits.isascii() and digits.isdigit()) or not 1 <= int(digits) <= 65535:
                raise ValueError(spec)
            n = int(size)
        else:
            link = size
        tiers.append((n, *parse_link(link)))
    return tuple(tiers)


def _link_spec(v: Any) -> bool:
    if v is None:
        return True
    if not isinstance(v, str):
        return False
    try:
        parse_links(v)
    except ValueError:
        return False
    return True


ALGORITHMS = ("auto", "ring", "direct", "nccl", "exchange")


def _parse_bool(text: str) -> bool:
    t = text.strip().lower()
    if t in ("1", "true", "on", "yes"):
        return True
    if t in ("0", "false", "off", "no"):
        return False
    raise ValueError(text)


def _tuning_setting(v: Any) -> bool:
    return isinstance(v, str) and bool(v)


_OPTIONS = {
    o.name: o
    for o in [
        _Option(
            "rings",
            "JAXRING_RINGS",
            2,
            int,
            _int_in(1, MAX_RINGS),
            f"an int from 1 to {MAX_RINGS}",
            "Rings per allreduce. The buffer is split into one part per "
            "ring; odd rings run in the opposite direction.",
        ),
        _Option(
            "chunk_bytes",
            "JAXRING_CHUNK_BYTES",
            1 << 20,
            int,
            _int_in(1, MAX_CHUNK_BYTES),
            "an int from 1 to 2**40",
            "Pipelining unit: each ring moves its part in chunks of at most this many bytes.",
        ),
        _Option(
            "algorithm",
            "JAXRING_ALGORITHM",
            "auto",
            str,
            lambda v: v in ALGORITHMS,
            'one of "auto", "ring", "direct", "nccl", "exchange"',
            'How the ranks combine their buffers. "ring": the chunked '
            'multi-ring schedule. "direct" (devices of one process, or '
            "processes of one host over a shared-memory segment they "
            "all map): each rank reduces its segment of every rank's "
            "input and writes it into every rank's output, which moves "
            "each byte through memory about half as often as a ring. "
            '"nccl" (CUDA only): NCCL\'s own allreduce per chunk on the '
            'same rings, the built-in reference. "exchange" (CPU): '
            "recursive doubling, log2(n) exchanges of the whole buffer "
            "between partners instead of the ring's 2(n-1) steps, for "
            "small buffers whose time is the steps' latency. "
            '"auto" (default): on '
            "CPU, direct when every rank of the operation is in this "
            "process and cpu_link is off, and across processes of one "
            "host that share the host segment where topology is "
            '"auto" (one device per process or several); elsewhere '
            "across processes and under cpu_link, exchange for buffers "
            "of at most "
            "exchange_max_bytes, and, with exchange_max_bytes left "
            "unset under a cpu_link of one link, also up to 16 KiB "
            "where that link's cost model predicts it faster (unless "
            'topology names tiers or "flat"), and the ring '
            "otherwise; on GPU, the ring.",
        ),
        _Option(
            "exchange_max_bytes",
            "JAXRING_EXCHANGE_MAX_BYTES",
            512,
            int,
            _int_in(0, MAX_CHUNK_BYTES),
            "an int from 0 to 2**40",
            'With algorithm "auto", an allreduce across processes '
            "(or under cpu_link) of at most this many bytes runs the "
            "exchange algorithm (recursive doubling) rather than the "
            'ring; 0: never. Not where "auto" runs direct over the '
            "host segment (the processes of one host). The default, 512, won on every link "
            "measured; a fast network may raise it (docs/allreduce.md). A tuning "
            "table (python -m jaxring.tune across processes) chooses "
            "from its own measurements instead. Left unset under a "
            "cpu_link of one link, the exchange also runs up to 16 KiB "
            "where that link's cost model predicts it faster; set, it "
            "is the rule.",
        ),
        _Option(
            "topology",
            "JAXRING_TOPOLOGY",
            "auto",
            _topology.parse,
            _topology.is_setting,
            _topology.REQUIREMENT,
            "The tiers of the ring plan across processes, tightest "
            "first, e.g. (4, 2, 8) for 4 devices per process, 2 "
            "processes per host, 8 hosts (JAXRING_TOPOLOGY=4x2x8). The "
            "tiered plan reduce-scatters inside each tier before it "
            'crosses the next, so loose tiers carry less. "auto" '
            "(default): derived from where the ranks run (process, host "
            'address); "flat": one ring over all ranks.',
        ),
        _Option(
            "timeout_s",
            "JAXRING_TIMEOUT_S",
            300.0,
            float,
            _number_in(MAX_TIMEOUT_S),
            f"a finite number of seconds, above 0 and at most {MAX_TIMEOUT_S:.0f} (7 days)",
            "Seconds an allreduce waits for its peers before it fails "
            "with an error that names the missing ranks.",
        ),
        _Option(
            "tuning",
            "JAXRING_TUNING",
            "auto",
            str,
            _tuning_setting,
            '"auto", "off" or the path of a tuning file',
            "Where rings, chunk_bytes, algorithm and topology come from "
            "when they are not set (topology only with the algorithm, or "
            'under an algorithm other than "auto"): "auto" (default) '
            "takes them, per message "
            "size, from the table `python -m jaxring.tune` wrote to the "
            "cache (~/.cache/jaxring/tuning.json) for this topology, if "
            'there is one; a path names another such file; "off" '
            "uses the settings' defaults. A value set explicitly (an "
            "argument, config.update, the environment) always wins.",
        ),
        _Option(
            "cpu_link",
            "JAXRING_CPU_LINK",
            None,
            lambda s: s or None,
            _link_spec,
            'None, a link such as "10Gbit,20us" (at least 8bit, '
            "a finite latency of at most 60s), or one link per tier such as "
            '"4:100Gbit,2us;1Gbit,20us" (a size on every tier but the last)',
            "Link emulation for the in-process CPU transport: every "
            "device's outgoing transfers share one link of this bandwidth "
            "and arrive this much later. Several links, tightest first, "
            'emulate a cluster of tiers: "4:100Gbit,2us;1Gbit,20us" is '
            "hosts of 4 ranks on 100 Gbit links, each host sharing one "
            "1 Gbit link to the others. Waiting costs wall time, not CPU, "
            "so compute and communication compete as on a real network. "
            "An emulation for measuring overlap and plans on one machine; "
            "None (default) moves data at memory speed.",
        ),
        _Option(
            "cpu_gang_start",
            "JAXRING_CPU_GANG_START",
            True,
            _parse_bool,
            lambda v: isinstance(v, bool),
            "True or False (in the environment: 1, true, yes or on; 0, false, no or off)",
            "On CPU, where every rank of an overlapped bucket is a "
            "virtual device of this process: its start waits (up to 1 s) "
            "until every device has reached it, so a device that runs "
            "ahead gives its cores to the ones the ring waits for. "
            "False: a start returns at once. No effect on the values, "
            "across processes or on GPU.",
        ),
    ]
}


class Config:
    """jax.config-like access to jaxring's settings.

    Example:
        >>> import jaxring
        >>> jaxring.config.update("rings", 4)
        >>> jaxring.config.rings
        4
        >>> jaxring.config.reset("rings")
    """

    def __init__(self) -> None:
        object.__setattr__(self, "_values", {})
        object.__setattr__(self, "_explicit", set())
        for opt in _OPTIONS.values():
            raw = os.environ.get(opt.env)
            if raw is None:
                value = opt.default
            else:
                try:
                    value = opt.parse(raw)
                except ValueError:
                    raise ValueError(f"{opt.env}={raw!r}: expected {opt.requirement}") from None
                if not opt.check(value):
                    raise ValueError(f"{opt.env}={raw!r}: expected {opt.requirement}")
                self._explicit.add(opt.name)
            self._values[opt.name] = value

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(
                f"jaxring.config has no setting {name!r}; settings: {sorted(_OPTIONS)}"
            ) from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("use jaxring.config.update(name, value)")

    def update(self, name: str, value: Any) -> None:
        """Sets a setting for functions traced from now on."""
        opt = _OPTIONS.get(name)
        if opt is None:
            raise AttributeError(
                f"jaxring.config has no setting {name!r}; settings: {sorted(_OPTIONS)}"
            )
        validate(name, value)
        self._values[name] = value
        self._explicit.add(name)

    def reset(self, name: str) -> None:
        """Returns a setting to its default (ignoring the environment)."""
        self._values[name] = _OPTIONS[name].default
        self._explicit.discard(name)

    def is_explicit(self, name: str) -> bool:
        """Whether the setting was given (environment or update) rather than
        left at its default; a tuning table only replaces defaults."""
        return name in self._explicit

    def describe(self) -> dict[str, dict[str, Any]]:
        """Each setting's value, environment variable and meaning."""
        return {
            n: {"value": self._values[n], "env": o.env, "default": o.default, "doc": o.doc}
            for n, o in _OPTIONS.items()
        }


def validate(name: str, value: Any, where: str = "jaxring.config") -> Any:
    opt = _OPTIONS[name]
    if not opt.check(value):
        raise ValueError(f"{where}: {name} must be {opt.requirement}, got {value!r}")
    return value


config = Config()
