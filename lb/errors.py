"""The exceptions the edge raises on purpose, each saying whose fault it is (urllib3's exceptions.py).

One module, a leaf every room may import: an error is raised in one room and caught in another
(the parser raises HttpError, the pipeline answers it; config raises ConfigError, edge.py prints it),
and neither should have to import the other's room for the type. An exception raised and caught inside
one module stays there (forward's UpstreamFailed, spool's SpoolError, limiter's own: limiter is a
library that knows nothing of lb).
"""

from __future__ import annotations

# ---------------------------------------------------------------- the operator's: the process does not start


class ConfigError(ValueError):
    """One or more configuration values are wrong; each problem is one line naming the key and the value."""

    def __init__(self, *problems: str):
        self.problems = list(problems)
        super().__init__("; ".join(problems))


class StartError(Exception):
    """The process could not start; the message names what failed (`--listen 1.2.3.4:80: ...`)."""


# ---------------------------------------------------------------- the client's: the edge answers it itself


class HttpError(Exception):
    """A request the edge answers itself: status, short reason. close=True when framing is lost."""

    def __init__(self, status: int, reason: str, close: bool = True):
        super().__init__(reason)
        self.status, self.reason, self.close = status, reason, close


class ClientGone(Exception):
    """The client closed or reset its connection while we were answering."""


# ---------------------------------------------------------------- the backend's, or the way to it


class UpstreamError(Exception):
    """The backend failed us: kind is 'connect', 'reset', 'timeout' or 'protocol'."""

    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind, self.detail = kind, detail


class PoolExhausted(Exception):
    """Every connection to this backend is busy and none came free within pool_timeout."""


class ResolveError(Exception):
    """A backend's DNS name did not resolve: the server's answer, or why there was none."""
