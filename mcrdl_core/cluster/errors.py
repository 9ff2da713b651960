"""Errors of the emulated cluster (``mcrdl cluster``)."""
from __future__ import annotations

from ..base.errors import InvalidArgumentError, McrdlError


class ClusterError(McrdlError, RuntimeError):
    """Building, using or removing an emulated cluster failed; the message names the
    command that failed and what to do."""


class ClusterPermissionError(McrdlError, PermissionError):
    """The process may not create network namespaces (needs root or CAP_NET_ADMIN and
    CAP_SYS_ADMIN)."""


class ClusterSpecError(InvalidArgumentError):
    """A bad cluster description (host count, rate, delay, host name); nothing was built."""
