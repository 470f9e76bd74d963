"""The exceptions kvroute raises, one per way a call can fail that a caller can act on.

Every one derives from :class:`KvrouteError`; those that match a built-in category also
derive from it (``ValueError``, ``TimeoutError``, ``ConnectionError``, ``KeyError``), so
``except TimeoutError`` catches a holder that did not answer in time. The Rust crates'
error enums map onto them variant by variant (docs/python.md has the table).
"""

from __future__ import annotations

__all__ = [
    "KvrouteError",
    "InvalidInputError",
    "BusyError",
    "TimedOutError",
    "RefusedError",
    "UnreachableError",
    "CorruptError",
    "NotFoundError",
    "CacheFullError",
    "PinnedError",
    "TransportError",
]


class KvrouteError(Exception):
    """Base class of every error kvroute raises."""


class InvalidInputError(KvrouteError, ValueError):
    """An argument, shape, configuration or parameter is out of its range (nothing ran)."""


class BusyError(KvrouteError):
    """A holder serves its cap of requesters: try later or another replica."""


class TimedOutError(KvrouteError, TimeoutError):
    """A holder did not answer within the requester's timeout (it is now dead here)."""


class RefusedError(KvrouteError):
    """A holder refused a session or a request (its reason is in the message)."""


class UnreachableError(KvrouteError, ConnectionError):
    """A holder could not be reached, was lost, or no live copy of a chunk is left."""


class CorruptError(KvrouteError):
    """Bytes failed their check: a stored block's checksum, a malformed reply or line."""


class NotFoundError(KvrouteError, KeyError):
    """A stored block, chunk or preset does not exist."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class CacheFullError(KvrouteError):
    """The prefix cache cannot make room: every block is pinned or the insert is too large."""


class PinnedError(KvrouteError):
    """The prefix-cache block is pinned (remove) or not pinned (unpin)."""


class TransportError(KvrouteError):
    """The transfer engine or the fabric failed (a provider missing, a transfer refused)."""
