"""`edge.py --check`: what the configuration parser cannot see, checked without starting anything.

The parser already refused bad values (one line per problem). Here: the listen and admin hosts
resolve to an address of this kind of socket, the access log can be opened for appending, the store
URL names a host that resolves, no two TLS certificates claim one name and none has expired (the edge
serves them anyway, as nginx does: a warning at start, a problem here). Nothing is bound, opened for
writing or connected to, so it is safe to run next to the running edge (the systemd unit's ExecReload
runs it before sending HUP).
"""

from __future__ import annotations

import os
import socket

from lb.netaddr import hostport


def problems(cfg) -> list[str]:
    out: list[str] = []
    for key, addr in (("listen", cfg.listen), ("admin", cfg.admin)):
        if addr is None:
            continue
        host, port = addr
        try:
            socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        except (OSError, UnicodeError) as e:
            out.append(f"{key} {hostport(host, port)}: {getattr(e, 'strerror', None) or e}")
    if cfg.admin and cfg.admin == cfg.listen and cfg.listen[1]:
        out.append(f"admin {hostport(*cfg.admin)}: the same address as listen")
    if cfg.access_log and cfg.access_log != "-":
        out += _writable(cfg.access_log, "access_log")
    if cfg.store != "memory":
        from lb.limiting.store import redis_files
        from limiter.redis import url as redis_url

        target = redis_url.parse(cfg.store, **redis_files(cfg))  # parsed already: it does not raise here
        if target.socket and not os.path.exists(target.socket):
            out.append(f"limits.store {target.display}: No such file or directory")
        for host, _ in target.hosts:
            try:
                socket.getaddrinfo(host, None)
            except (OSError, UnicodeError) as e:
                out.append(f"limits.store {target.display}: {host}: {getattr(e, 'strerror', None) or e}")
    if cfg.tls_cert:
        out += certificate_warnings(cfg)
    return out


def certificate_warnings(cfg) -> list[str]:
    from lb.http.tls import CertSpec, cert_info, duplicate_names, expired

    specs = [CertSpec(cfg.tls_cert, cfg.tls_key), *cfg.tls_certificates]
    out = [f"tls: {s.cert}: expired {cert_info(s.cert)['notAfter']}" for s in specs if expired(cert_info(s.cert))]
    out += [f"tls: {d} both claim the name (the first serves it)" for d in duplicate_names(specs)]
    return out


def _writable(path: str, key: str) -> list[str]:
    if os.path.exists(path):
        if os.path.isdir(path):
            return [f"{key} {path}: Is a directory"]
        return [] if os.access(path, os.W_OK) else [f"{key} {path}: Permission denied"]
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        return [f"{key} {path}: No such file or directory"]
    return [] if os.access(parent, os.W_OK | os.X_OK) else [f"{key} {path}: Permission denied"]
