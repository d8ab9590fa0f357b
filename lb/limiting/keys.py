"""Known API keys: who may claim a key identity, at which tier -- and how a key is named in logs.

Without a registry any X-Api-Key value is an identity of its own, so a client can mint a fresh quota
per request by inventing keys. With one (`[limits] api_keys_file` or `[[keys]]` tables), only the
listed keys are identities; an unknown key is treated as no key at all (the client is limited by its
IP, `unknown_keys = "as-ip"`, the default) or refused with 401 (`unknown_keys = "reject"`).

    # keys.toml (reloaded on SIGHUP with the rest of the configuration)
    [tiers]
    free = "60/m"
    pro = "6000/m"

    [[keys]]
    name = "acme"                 # what logs, metrics and overrides call it ("key:acme")
    key = "k-3f1e..."             # the secret, or:  sha256 = "<hex digest of the secret>"
    tier = "pro"                  # or:  limit = "100/s"; neither: the [limits] default

A key never appears in logs or metrics: a known key by its name, any other by `#` and 12 hex digits of
a keyed BLAKE2b hash (the hash key is EDGE_KEY_HASH_SECRET when set -- the same on every edge, so lines
from several edges line up -- else random per start).
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
import tomllib
from dataclasses import dataclass, field

from limiter import parse_rate

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_label_secret: bytes | None = None  # drawn by draw_label_secret(), never at import
_draw_lock = threading.Lock()


def draw_label_secret() -> bytes:
    """The secret key_label hashes with: EDGE_KEY_HASH_SECRET, or 32 random bytes; drawn once per process.

    Called where it must be the same for everyone: the supervisor before it forks (every worker labels
    a key alike, so their metrics and logs agree), the App before its serving threads start."""
    global _label_secret
    with _draw_lock:
        if _label_secret is None:
            _label_secret = hashlib.blake2b(
                os.environ.get("EDGE_KEY_HASH_SECRET", "").encode() or os.urandom(32), digest_size=32
            ).digest()
        return _label_secret


def key_label(api_key: bytes) -> str:
    """How an API key that is not a known key's appears in logs and metrics: never the key itself.
    A keyed hash, computed once per key rather than per request (the cache is bounded: emptied when full)."""
    label = _labels.get(api_key)
    if label is None:
        if len(_labels) >= _LABELS_MAX:
            _labels.clear()  # a key-rotating client costs a hash per key, as without the cache
        secret = _label_secret or draw_label_secret()
        label = _labels[api_key] = "key:#" + hashlib.blake2b(api_key, key=secret, digest_size=6).hexdigest()
    return label


_labels: dict[bytes, str] = {}
_LABELS_MAX = 4096


@dataclass(frozen=True)
class KeySpec:
    name: str
    secret: bytes | None = field(default=None, repr=False)  # the raw key, or
    sha256: str | None = field(default=None, repr=False)  # its SHA-256 (the file need not hold secrets)
    limit: str | None = None  # the key's own rate (its tier's); None: default


def parse_keys(tables, tiers, where: str) -> tuple[KeySpec, ...]:
    """[[keys]] tables -> KeySpecs; tiers: {name: rate}. ValueError naming the entry on anything wrong."""
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise ValueError(f"{where}: expected [[keys]] tables with name and key")
    out = []
    for i, t in enumerate(tables):
        at = f"{where}[{i}]"
        unknown = set(t) - {"name", "key", "sha256", "tier", "limit"}
        if unknown:
            raise ValueError(f"{at}: unknown key {sorted(unknown)[0]!r} (known: name, key, sha256, tier, limit)")
        name = t.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"{at}.name: letters, digits, '_', '.', '@', '-' (at most 64), got {name!r}")
        at = f"{where}[{i}] ({name})"
        secret, digest = t.get("key"), t.get("sha256")
        if (secret is None) == (digest is None):
            raise ValueError(f"{at}: give exactly one of key or sha256")
        if secret is not None and (
            not isinstance(secret, str)
            or not secret
            or len(secret) > 256
            or not secret.isprintable()
            or secret != secret.strip()
        ):
            raise ValueError(f"{at}.key: a printable string of 1-256 characters without surrounding spaces")
        if digest is not None and (not isinstance(digest, str) or not _HEX64.fullmatch(digest.lower())):
            raise ValueError(f"{at}.sha256: expected 64 hex digits")
        tier, limit = t.get("tier"), t.get("limit")
        if tier is not None and limit is not None:
            raise ValueError(f"{at}: give tier or limit, not both")
        if tier is not None:
            if tier not in tiers:
                raise ValueError(f"{at}.tier: no tier {tier!r} (defined: {', '.join(tiers) or 'none'})")
            limit = tiers[tier]
        if limit is not None:
            try:
                parse_rate(limit)
            except ValueError as e:
                raise ValueError(f"{at}.limit: {e}") from None
        out.append(
            KeySpec(
                name=name,
                secret=secret.encode("latin-1") if secret else None,
                sha256=digest.lower() if digest else None,
                limit=limit,
            )
        )
    return tuple(out)


def parse_tiers(value, where: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise ValueError(f'{where}: expected a table of tier = "N/PERIOD"')
    for name, rate in value.items():
        try:
            parse_rate(rate)
        except ValueError as e:
            raise ValueError(f"{where}.{name}: {e}") from None
    return dict(value)


def read_keys_file(path: str, tiers: dict) -> tuple[KeySpec, ...]:
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as e:
        raise ValueError(f"limits.api_keys_file: cannot read {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"limits.api_keys_file: {path} is not valid TOML: {e}") from None
    unknown = set(doc) - {"keys", "tiers"}
    if unknown:
        raise ValueError(f"limits.api_keys_file: {path}: unknown key {sorted(unknown)[0]!r} (known: tiers, keys)")
    merged = {**tiers, **parse_tiers(doc.get("tiers", {}), f"{path}: tiers")}
    return parse_keys(doc.get("keys", []), merged, f"{path}: keys")


def check_unique(keys) -> None:
    names, secrets = set(), set()
    for k in keys:
        if k.name in names:
            raise ValueError(f"keys: two keys are named {k.name!r}")
        names.add(k.name)
        s = k.sha256 or hashlib.sha256(k.secret).hexdigest()
        if s in secrets:
            raise ValueError(f"keys: key {k.name!r} has the same secret as another key")
        secrets.add(s)


class KeyRegistry:
    """Lookup of a presented X-Api-Key among the known keys."""

    def __init__(self, keys):
        self.by_secret = {k.secret: k for k in keys if k.secret is not None}
        self.by_sha = {k.sha256: k for k in keys if k.sha256 is not None}
        self.names = {k.name: k for k in keys}

    def lookup(self, api_key: bytes) -> KeySpec | None:
        k = self.by_secret.get(api_key)
        if k is None and self.by_sha:
            k = self.by_sha.get(hashlib.sha256(api_key).hexdigest())
        return k
