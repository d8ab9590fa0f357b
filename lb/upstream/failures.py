"""How a try on a backend failed, before any response byte reached the client: the kinds, each with the
status the client gets and the reason its body says.

A str enum: the kinds are also the retry conditions' names (lb/upstream/retrypolicy.py), the metrics'
`kind` label and the log's word, so Failure.RESET == "reset" and formats as "reset".
"""

from __future__ import annotations

from enum import StrEnum


class Failure(StrEnum):
    CONNECT = "connect", 502, "backend unreachable"
    RESET = "reset", 502, "backend closed the connection"
    TIMEOUT = "timeout", 504, "backend timed out"
    PROTOCOL = "protocol", 502, "backend sent an invalid response"
    POOL = "pool", 503, "backend connection limit reached"  # our limit (max_conns), not the backend's fault
    GONE = "gone", 502, "backend removed"  # its pool closed by a reload
    HEDGED = "hedged", 502, "answered by another backend"  # lost a hedge race (lb/proxy/hedge.py): never answered

    status: int  # what the client gets (set by __new__; annotations alone are not members)
    reason: str

    def __new__(cls, value: str, status: int, reason: str):
        m = str.__new__(cls, value)
        m._value_ = value
        m.status = status
        m.reason = reason
        return m


# Whose fault: a full pool or a removed backend says nothing of the backend's health (passive health).
NOT_THE_BACKENDS = frozenset({Failure.POOL, Failure.GONE})
