"""jaxring's exception types, and the translation of XLA's errors into them.

A jaxring allreduce fails inside a compiled XLA program, and XLA reports the
failure with its own exception type (``jax.errors.JaxRuntimeError``, or a
``ValueError`` for some status codes) when the result is fetched. The message
is jaxring's; ``translate_errors`` turns such an exception into the
``JaxringError`` subclass that says what happened, with the operation and the
peer as attributes, chained to XLA's original (``__cause__``).
"""

from __future__ import annotations

import contextlib
import re


class JaxringError(RuntimeError):
    """A failure jaxring detected.

    Attributes:
      operation: the failed allreduce as jaxring names it, e.g.
        ``"op 3, group 0, run 7"``, or None where the message names none.
      peer_process: the process the failure points at: the one found lost,
        the one a timed-out rank waited for (when it waited for one only),
        or else the one that reported the failure; None if none is known.
    """

    def __init__(self, message: str, operation: str | None = None,
                 peer_process: int | None = None):
        super().__init__(message)
        self.operation = operation
        self.peer_process = peer_process


class PeerLostError(JaxringError):
    """A peer process exited, closed its connections or sent an abort."""


class CollectiveTimeoutError(JaxringError):
    """An allreduce did not complete within its timeout: a peer stopped
    responding, or the processes do not run the same allreduces."""


class MismatchError(JaxringError):
    """Ranks called one allreduce with different shapes, dtypes or ops, or
    processes compiled different programs."""


_OPERATION = re.compile(
    r"jaxring allreduce(?: done)? \((op -?\d+(?:, group -?\d+)?(?:, run -?\d+)?)")
_UNREACHABLE = re.compile(r"process (\d+) \([^)]*\) is unreachable")
_WAITS_FOR = re.compile(r"waits for rank \d+ \(process (\d+)\)")
_REPORTED_BY = re.compile(r"\[reported by process (\d+)\]")

# The class for each kind of message; the first that matches wins, so the
# cause (a lost peer) is reported ahead of its consequences.
_KINDS = (
    (PeerLostError, re.compile(r"is unreachable|cannot send to rank")),
    (MismatchError, re.compile(r"must pass the same|different program|"
                               r"does not fit the plan|disagree")),
    (CollectiveTimeoutError, re.compile(r"timed out after")),
)


for _cls in (JaxringError, PeerLostError, CollectiveTimeoutError, MismatchError):
    _cls.__module__ = "jaxring"  # shown in tracebacks as jaxring.PeerLostError


def translate(exc: BaseException) -> JaxringError | None:
    """The JaxringError for an exception XLA raised with jaxring's message;
    None if the exception is not a jaxring failure."""
    if isinstance(exc, JaxringError):
        return exc
    message = str(exc)
    if "jaxring allreduce" not in message:
        return None
    op = _OPERATION.search(message)
    cls = next((c for c, pattern in _KINDS if pattern.search(message)), JaxringError)
    return cls(message, operation=op.group(1) if op else None,
               peer_process=_peer_of(message))


def _peer_of(message: str) -> int | None:
    lost = _UNREACHABLE.search(message)
    if lost:
        return int(lost.group(1))
    # A timeout lists the process each unfinished ring waits for; which of
    # them is stuck is known only if there is one.
    waited_for = set(_WAITS_FOR.findall(message))
    if len(waited_for) == 1:
        return int(waited_for.pop())
    if waited_for:
        return None
    reporter = _REPORTED_BY.search(message)
    return int(reporter.group(1)) if reporter else None


class translate_errors(contextlib.ContextDecorator):
    """Raises jaxring's failures inside the block (or decorated function) as
    ``JaxringError`` subclasses instead of XLA's generic exception::

        with jaxring.translate_errors():
            for batch in data:
                state, loss = train_step(state, batch)
                print(float(loss))        # a lost peer raises PeerLostError here

    Other exceptions pass through unchanged. ``python -m jaxring.launch``
    runs every script inside it.
    """

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is None or isinstance(exc, JaxringError):
            return False
        translated = translate(exc)
        if translated is None:
            return False
        raise translated.with_traceback(tb) from exc
