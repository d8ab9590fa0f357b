"""How a setting's value is written: one Kind per shape, reading it from the TOML file and from a flag.

A Kind turns what the file holds (TOML types) or what a flag gave (a string, True for a switch, a list
for a repeatable flag) into the value Config keeps, or raises ConfigError naming the key: the dotted
TOML path (`health.interval`) or the flag (`--health-interval`), so both spellings get the same
message. The tables of tables ([[backends]], [[tls.certificates]], [limits.keys]) are Kinds too, with
their own parsers here; [[rules]] and [[keys]] keep theirs in lb/limiting (called from here).

A leaf: the standard library, lb.netaddr and lb.upstream.retrypolicy (itself a leaf) only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from urllib.parse import urlsplit

from lb.errors import ConfigError
from lb.http.tls import CertSpec
from lb.netaddr import hostport, split_hostport
from lb.upstream.backends import BackendSpec
from lb.upstream.retrypolicy import parse_conditions


class Kind:
    """The shape of one setting's value. Subclasses override file() and, where a flag spells it
    differently, flag(); `action` is the flag's argparse action (None: it takes one value), `metavar`
    how --help and the README write its value (None: the setting's own, or argparse's NAME)."""

    action: str | None = None
    metavar: str | None = None

    def file(self, value, key: str):
        raise NotImplementedError

    def flag(self, value, key: str):
        return self.file(value, key)

    def toml_shown(self, path: str) -> str:
        """`listen`, `[health] path`: how the README's table names the key."""
        section, _, key = path.rpartition(".")
        return f"`[{section}] {key}`" if section else f"`{path}`"


class Str(Kind):
    def file(self, value, key):
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value

    def flag(self, value, key):
        return value


class Bool(Kind):
    """true/false in the file; a switch (no value) as a flag."""

    action = "store_true"

    def file(self, value, key):
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value

    def flag(self, value, key):
        return value


class OnOff(Kind):
    """true/false in the file, on|off too (nginx's spelling); a flag takes on|off."""

    metavar = "on|off"

    def file(self, value, key):
        if isinstance(value, str) and value.lower() in ("on", "off"):
            return value.lower() == "on"
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected on or off (true or false), got {value!r}")
        return value


@dataclass(frozen=True)
class Num(Kind):
    """The range of one numeric setting: every number is finite and inside [lo, hi] (or 0, if zero)."""

    integer: bool
    lo: float
    hi: float
    zero: bool = False  # 0 allowed too ("none", "off") below lo

    @property
    def metavar(self) -> str:  # type: ignore[override]
        return "S" if not self.integer and self.lo == MS else "N"  # seconds, or a count

    def file(self, value, key):
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        try:
            n = int(value) if self.integer else float(value)
            if self.integer and float(value) != n:
                raise ValueError
        except (TypeError, ValueError, OverflowError):
            kind = "a whole number" if self.integer else "a number"
            raise ConfigError(f"{key}: expected {kind}, got {value!r}") from None
        if not math.isfinite(n) or not (self.lo <= n <= self.hi or (self.zero and n == 0)):
            zero = "0 or " if self.zero else ""
            raise ConfigError(f"{key}: must be {zero}a finite number >= {self.lo:g} and <= {self.hi:g}, got {value!r}")
        return n


DAY = 86400.0
MS = 0.001  # the shortest duration: `1e-300` is no timeout anyone means (and rounds to 1 us in the kernel)
SECONDS = Num(False, MS, DAY)  # a duration that must be > 0
SECONDS0 = Num(False, MS, DAY, zero=True)  # a duration where 0 means "none"
STREAK = Num(True, 1, 1000)
PERCENT = Num(False, 0.0, 100.0)


def parse_hostport(value: str, key: str) -> tuple[str, int]:
    parts = split_hostport(value)
    if parts is None or not parts[1].isdigit() or not 0 <= int(parts[1]) <= 65535:
        raise ConfigError(f"{key}: expected HOST:PORT or [IPV6]:PORT, got {value!r}")
    return parts[0], int(parts[1])


class HostPort(Kind):
    metavar = "HOST:PORT"

    def file(self, value, key):
        return parse_hostport(value, key)


class List(Kind):
    """A TOML list; a flag writes it comma separated."""

    def file(self, value, key):
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return tuple(value)

    def flag(self, value, key):
        return tuple(x for x in value.split(",") if x.strip())


class RetryOn(Kind):
    """ "connect,503" or ["connect", "503"]: the conditions lb/upstream/retrypolicy.py knows."""

    def file(self, value, key):
        if not isinstance(value, (str, list)):
            raise ConfigError(f"{key}: expected a list of conditions, got {value!r}")
        try:
            return parse_conditions(value)
        except ValueError as e:
            raise ConfigError(f"{key}: {e}") from None


class RateTable(Kind):
    """A table of "key" = "N/PERIOD" ([limits.keys], [limits.tiers]); the flag: KEY=N/PERIOD, repeatable."""

    action = "append"

    def file(self, value, key):
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise ConfigError(f'{key}: expected a table of "key" = "N/PERIOD", got {value!r}')
        return tuple(value.items())

    def flag(self, value, key):
        pairs = []
        for item in value:
            k, sep, rate = item.rpartition("=")
            if not sep or not k:
                raise ConfigError(f"{key}: expected KEY=N/PERIOD, got {item!r}")
            pairs.append((k, rate))
        return tuple(pairs)

    def toml_shown(self, path):
        return f"`[{path}]`"


class Certificates(Kind):
    """[[tls.certificates]]: an array of tables inside [tls], each a cert and a key."""

    def file(self, value, key):
        if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
            raise ConfigError(f"{key}: expected [[tls.certificates]] tables with cert and key")
        specs = []
        for i, t in enumerate(value):
            unknown = set(t) - {"cert", "key"}
            if unknown:
                raise ConfigError(f"{key}[{i}]: unknown key {sorted(unknown)[0]!r} (known: cert, key)")
            for k in ("cert", "key"):
                if not isinstance(t.get(k), str) or not t[k]:
                    raise ConfigError(f"{key}[{i}]: missing {k} (a PEM file path)")
            specs.append(CertSpec(t["cert"], t["key"]))
        return tuple(specs)

    def toml_shown(self, path):
        return f"`[[{path}]]` `cert`, `key`"


def parse_backend_url(url: str, weight, key: str) -> BackendSpec:
    try:
        parts = urlsplit(str(url))
        port = parts.port
    except ValueError:
        raise ConfigError(f"{key}: bad backend URL {url!r}") from None
    if parts.scheme not in ("http", "https", "h2c") or not parts.hostname or parts.path not in ("", "/") or parts.query:
        raise ConfigError(
            f"{key}: bad backend URL {url!r} (expected http://HOST[:PORT], https://... or h2c://... "
            f"(HTTP/2, gRPC), [IPV6] in brackets, no path)"
        )
    if isinstance(weight, bool) or not isinstance(weight, int) or weight < 1:
        raise ConfigError(f"{key}: weight must be a whole number >= 1, got {weight!r} for {url}")
    port = port or (443 if parts.scheme == "https" else 80)
    return BackendSpec(
        url=f"{parts.scheme}://{hostport(parts.hostname, port)}",
        weight=weight,
        host=parts.hostname,
        port=port,
        scheme=parts.scheme,
    )


class Backends(Kind):
    """[[backends]] tables with url and weight; the flag: URL[=WEIGHT],..."""

    def file(self, value, key):
        if not isinstance(value, list) or not all(isinstance(b, dict) for b in value):
            raise ConfigError("backends: expected [[backends]] tables with url and weight")
        specs = []
        for i, b in enumerate(value):
            unknown = set(b) - {"url", "weight"}
            if unknown:
                raise ConfigError(f"backends[{i}]: unknown key {sorted(unknown)[0]!r} (known: url, weight)")
            if "url" not in b:
                raise ConfigError(f"backends[{i}]: missing url")
            specs.append(parse_backend_url(b["url"], b.get("weight", 1), f"backends[{i}]"))
        return tuple(specs)

    def flag(self, value, key):
        specs = []
        for item in value.split(","):
            item = item.strip()
            if not item:
                raise ConfigError(f"{key}: empty entry in {value!r}")
            url, sep, w = item.partition("=")
            if sep:
                try:
                    weight = int(w)
                except ValueError:
                    raise ConfigError(f"{key}: weight must be a whole number >= 1, got {w!r} for {url}") from None
            else:
                weight = 1
            specs.append(parse_backend_url(url, weight, key))
        return tuple(specs)

    def toml_shown(self, path):
        return f"`[[{path}]] url, weight`"


class Rules(Kind):
    """[[rules]]: lb/limiting/rules.py parses them (RuleSpec per table)."""

    def file(self, value, key):
        from lb.limiting.rules import parse_rules  # the limiting room owns the rule grammar

        try:
            return parse_rules(value)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def toml_shown(self, path):
        return f"`[[{path}]]`"


class KeyTables(Kind):
    """[[keys]]: kept as read; load() parses them with lb/limiting/keys.py once [limits.tiers] is known."""

    def file(self, value, key):
        return value

    def toml_shown(self, path):
        return f"`[[{path}]]`"


STR, BOOL, ONOFF, HOSTPORT, LIST = Str(), Bool(), OnOff(), HostPort(), List()
RETRY_ON, RATES, CERTIFICATES, BACKENDS, RULES, KEYS = (
    RetryOn(),
    RateTable(),
    Certificates(),
    Backends(),
    Rules(),
    KeyTables(),
)
