"""jaxring's exception types, and the translation of XLA's errors into them.

A jaxring allreduce fails inside a compiled XLA program, and XLA reports the
failure with its own exception type (``jax.errors.JaxRuntimeError``, or a
``ValueError`` for some status codes) when the result is fetched. The message
is jaxring's, and starts with a tag written where the failure was found
(``xla_ffi/failure.h``), e.g. ``[jaxring kind=peer_lost peer=1]``;
``translate_errors`` turns such an exception into the ``JaxringError``
subclass the tag names, with the operation and the peer as attributes,
chained to XLA's original (``__cause__``). Only the first tag counts: text a
peer reported comes after it and chooses nothing.
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

    def __init__(self, message: str, operation: str | None = None, peer_process: int | None = None):
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


_TAG = re.compile(r"\[jaxring kind=([a-z_]+) peer=(-1|\d+)\] ")
_OPERATION = re.compile(
    r"jaxring allreduce(?: done| start)? \((op -?\d+(?:, group -?\d+)?(?:, run -?\d+)?)"
)

# The class for each kind a tag can name (xla_ffi/failure.h).
_CLASSES = {
    "peer_lost": PeerLostError,
    "timeout": CollectiveTimeoutError,
    "mismatch": MismatchError,
}


for _cls in (JaxringError, PeerLostError, CollectiveTimeoutError, MismatchError):
    _cls.__module__ = "jaxring"  # shown in tracebacks as jaxring.PeerLostError


def translate(exc: BaseException) -> JaxringError | None:
    """The JaxringError for an exception XLA raised with jaxring's message;
    None if the exception is not a jaxring failure."""
    if isinstance(exc, JaxringError):
        return exc
    message = str(exc)
    tag = _TAG.search(message)
    if tag is None:
        # Not from a jaxring handler (or from a build before tags): no kind.
        if "jaxring allreduce" not in message:
            return None
        op = _OPERATION.search(message)
        return JaxringError(message, operation=op.group(1) if op else None)
    # The operation is named right after the tag, before any peer's words.
    op = _OPERATION.search(message, tag.end())
    peer = int(tag.group(2))
    return _CLASSES.get(tag.group(1), JaxringError)(
        message, operation=op.group(1) if op else None, peer_process=peer if peer >= 0 else None
    )


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
