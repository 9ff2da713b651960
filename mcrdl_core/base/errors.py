"""Error types of MCR-DL.

Every error subclasses both :class:`McrdlError` and the familiar Python base that a
caller would catch anyway (``ValueError``, ``TypeError``, ``RuntimeError``,
``TimeoutError``). Messages say what went wrong *and* what to do about it.
"""


class McrdlError(Exception):
    """Base class of every error raised by MCR-DL."""


class InvalidArgumentError(McrdlError, ValueError):
    """A call's arguments are wrong (sizes, splits, ranks, layout); nothing was sent."""


class DtypeError(McrdlError, TypeError):
    """A dtype MCR-DL (or the chosen backend) cannot handle; nothing was sent."""


class UnsupportedError(McrdlError, ValueError):
    """The chosen backend cannot do this op / dtype / device / reduce-op combination."""


class BackendUnavailableError(McrdlError, RuntimeError):
    """A backend was named that is not installed or cannot run here."""


class CommTimeoutError(McrdlError, TimeoutError, RuntimeError):
    """A wait ran past its timeout; the message names the op, group, backend and rank.

    Also a RuntimeError: that is what torch code catches from a backend (torch's own
    backends raise ``DistBackendError``, a RuntimeError, when a collective times out),
    while plain Python code catches TimeoutError."""


class TableError(McrdlError, ValueError):
    """A tuning table file is malformed; the message names the file and the reason."""


class MismatchError(McrdlError, RuntimeError):
    """Debug mode found ranks that disagree on a collective's shape, dtype or backend."""


class NotInitializedError(McrdlError, RuntimeError):
    """The runtime was used after ``destroy()``."""


class BrokenGroupError(McrdlError, RuntimeError):
    """A call on a group (or runtime) that an earlier fault left unusable: a wait ran
    past the runtime's timeout, so its communicators may hold operations that will
    never be matched. Raised at once; the message quotes the original error."""


class CommFailedError(McrdlError, RuntimeError):
    """A backend library reported that a call failed (a peer died or closed its
    connection, the library's own timeout fired). The message names op, group, backend
    and rank and quotes the library; the group is then broken (see BrokenGroupError)."""
