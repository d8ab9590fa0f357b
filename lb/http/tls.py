"""TLS termination with the standard library's ssl: the listener's contexts, and the handshake.

One SSLContext per certificate. The default one ([tls] cert/key) is the listener's; its sni_callback
picks another by the ClientHello's server name (exact names before wildcards, case-insensitive) and
sets sslobj.context, the only way the standard library lets a server choose a certificate. Every
context gets the same versions, ciphers, ALPN and client verification, because which of them OpenSSL
consults after the switch differs by setting; the session tickets stay the default context's.

The handshake runs on the connection's own thread under header_timeout (CPython bounds a whole
do_handshake() by the socket timeout, however the ClientHello trickles), so a silent or slow TLS
client holds one thread for at most that long and never delays anyone else's handshake.
"""

from __future__ import annotations

import hashlib
import os
import socket
import ssl
import time
from dataclasses import dataclass
from time import monotonic
from typing import Any

from lb.errors import ConfigError

MIN_VERSIONS = {"TLSv1.2": ssl.TLSVersion.TLSv1_2, "TLSv1.3": ssl.TLSVersion.TLSv1_3}
HANDSHAKE = 0x16  # the first byte of every TLS record carrying a ClientHello


CLIENT_AUTH = ("require", "optional")


@dataclass(frozen=True)
class CertSpec:
    """A certificate (chain) and its key: [tls] cert/key, or one [[tls.certificates]] table."""

    cert: str
    key: str


def server_context(
    cert: str,
    key: str,
    ciphers: str | None = None,
    min_version: str = "TLSv1.2",
    client_ca: str | None = None,
    client_auth: str = "require",
    client_crl: str | None = None,
    where: str = "",
    http2: bool = False,
) -> ssl.SSLContext:
    """A server context for the pair on disk; ConfigError (one line) when it cannot serve.

    client_ca: clients are asked for a certificate signed by it -- required (refused at the handshake
    without one) or optional (served without an identity); a certificate that does not verify is
    refused either way, as nginx's ssl_verify_client optional does. client_crl: a PEM CRL of that CA;
    the leaf is checked against it (a CA with no CRL in the file fails every client: OpenSSL's rule).
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = MIN_VERSIONS[min_version]  # TLS 1.0/1.1 refused at the handshake
    ctx.options |= ssl.OP_NO_COMPRESSION | ssl.OP_CIPHER_SERVER_PREFERENCE
    # An EOF without close_notify is a close, not an error (HTTP framing, not TLS,
    # detects a truncated request). Without it, OpenSSL 3 answers the EOF the edge itself causes when it
    # shuts the read side of an idle connection (evict_idle, wake_idle) with a decode_error alert: the
    # client saw an SSL error where a clean close (and our close_notify) was meant.
    ctx.options |= getattr(ssl, "OP_IGNORE_UNEXPECTED_EOF", 0)
    # h2 first when HTTP/2 is on (lb/http2/), as nginx and HAProxy offer it; a client without ALPN gets HTTP/1.1
    ctx.set_alpn_protocols(["h2", "http/1.1"] if http2 else ["http/1.1"])
    if ciphers:
        try:
            ctx.set_ciphers(ciphers)
        except ssl.SSLError:
            raise ConfigError(f"tls.ciphers: no usable cipher in {ciphers!r}") from None
    for what, path in (("cert", cert), ("key", key)):
        try:  # load_cert_chain's error names no file (None): say which one, and where it is set
            with open(path, "rb"):
                pass
        except OSError as e:
            # where: a [[tls.certificates]] entry ("tls.certificates[1]"); else the default pair's flag and key
            source = f"{where}.{what}" if where else f"--tls-{what} or [tls] {what}"
            raise ConfigError(
                f"tls: cannot read {path}: {e.strerror or e} (set by {source}: a PEM file the edge's user can read)"
            ) from None
    try:
        ctx.load_cert_chain(cert, key)
    except FileNotFoundError as e:  # load_cert_chain names no file: say which one is missing
        missing = e.filename or (cert if not os.path.exists(cert) else key)
        raise ConfigError(f"tls: cannot read {missing}: {e.strerror}") from None
    except PermissionError as e:
        raise ConfigError(f"tls: cannot read {e.filename}: {e.strerror}") from None
    except ssl.SSLError as e:
        why = (
            "the key does not match the certificate"
            if "KEY_VALUES_MISMATCH" in str(e)
            else (e.reason or str(e)).replace("_", " ").lower()
        )
        raise ConfigError(f"tls: cannot use certificate {cert} with key {key}: {why}") from None
    if client_ca:
        ctx.verify_mode = ssl.CERT_REQUIRED if client_auth == "require" else ssl.CERT_OPTIONAL
        _load_verify(ctx, client_ca, "tls.client_ca")
        if client_crl:
            _load_verify(ctx, client_crl, "tls.client_crl")
            ctx.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
    return ctx


def _load_verify(ctx: ssl.SSLContext, path: str, key: str) -> None:
    try:
        ctx.load_verify_locations(cafile=path)
    except ssl.SSLError as e:  # a file with no PEM certificate (or CRL) in it (an OSError too: first)
        raise ConfigError(f"{key}: cannot use {path}: {(e.reason or str(e)).replace('_', ' ').lower()}") from None
    except OSError as e:
        raise ConfigError(f"{key}: cannot read {path}: {e.strerror}") from None


# -------------------------------------------------------------------------------------------- SNI


def cert_info(path: str) -> dict:
    """The first certificate in a PEM file, decoded by OpenSSL (subject, subjectAltName, notAfter)."""
    try:
        # CPython's own tests' decoder: no third-party parser (private, so typeshed does not list it)
        return ssl._ssl._test_decode_cert(path)  # type: ignore[attr-defined]
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"tls: cannot read a certificate in {path}: {getattr(e, 'strerror', None) or e}") from None


def cert_names(info: dict) -> list[str]:
    """The DNS names a certificate serves, lower case: its SAN, else (an old certificate) its CN."""
    names = [v.lower().rstrip(".") for k, v in info.get("subjectAltName", ()) if k == "DNS"]
    if not names:
        names = [v.lower() for rdn in info.get("subject", ()) for k, v in rdn if k == "commonName"]
    return names


def expired(info: dict, now: float | None = None) -> bool:
    return ssl.cert_time_to_seconds(info["notAfter"]) < (time.time() if now is None else now)


def listener_context(default: CertSpec, more: tuple = (), strict_sni: bool = False, **settings) -> ssl.SSLContext:
    """The listener's context: `default`'s, choosing among `more` by SNI. settings: server_context's.

    A name two certificates claim goes to the first (the default before the others); --check says so.
    """
    ctx = server_context(default.cert, default.key, **settings)
    if not more and not strict_sni:
        return ctx
    exact: dict[str, ssl.SSLContext] = {}
    wild: dict[str, ssl.SSLContext] = {}  # "*.example.com" under "example.com"
    for spec, c in [(default, ctx)] + [
        (s, server_context(s.cert, s.key, **settings, where=f"tls.certificates[{i}]")) for i, s in enumerate(more)
    ]:
        for name in cert_names(cert_info(spec.cert)):
            if name.startswith("*."):
                wild.setdefault(name[2:], c)
            else:
                exact.setdefault(name, c)

    def choose(sslobj, server_name, _ctx):
        if server_name:
            name = server_name.lower().rstrip(".")
            c = exact.get(name)
            if c is None:
                dot = name.find(".")
                c = wild.get(name[dot + 1 :]) if dot > 0 else None  # one label only, as RFC 6125 says
            if c is not None:
                if c is not ctx:
                    sslobj.context = c
                return None
        if strict_sni:
            return ssl.ALERT_DESCRIPTION_UNRECOGNIZED_NAME
        return None  # the default certificate

    ctx.sni_callback = choose
    return ctx


def duplicate_names(specs) -> list[str]:
    """'NAME: FILE and FILE' for each name two certificates claim (the first serves it)."""
    seen: dict[str, str] = {}
    out = []
    for s in specs:
        for name in cert_names(cert_info(s.cert)):
            if name in seen and seen[name] != s.cert:
                out.append(f"{name}: {seen[name]} and {s.cert}")
            seen.setdefault(name, s.cert)
    return out


# ------------------------------------------------------------------------------ client certificates

_RDN = {
    "commonName": "CN",
    "organizationName": "O",
    "organizationalUnitName": "OU",
    "countryName": "C",
    "stateOrProvinceName": "ST",
    "localityName": "L",
    "domainComponent": "DC",
    "streetAddress": "STREET",
    "userId": "UID",
}


def _rfc2253(value: str) -> str:
    """An attribute value as RFC 2253 writes it; a byte outside printable ASCII as \\HH (its UTF-8), so
    the subject is plain ASCII in a header and a log line."""
    out = []
    for c in value:
        if c in ',+"\\<>;':
            out.append("\\" + c)
        elif c.isascii() and c.isprintable():
            out.append(c)
        else:
            out.append("".join(f"\\{b:02X}" for b in c.encode()))
    s = "".join(out)
    if s[:1] in ("#", " "):
        s = "\\" + s
    if s.endswith(" "):
        s = s[:-1] + "\\ "
    return s


def _element(v: str) -> str:
    """A URI or DNS value in an XFCC element: non-ASCII percent-encoded; quoted when it holds , ; = or " (as
    Envoy does)."""
    if not (v.isascii() and v.isprintable()):
        v = "".join(c if c.isascii() and c.isprintable() else "".join(f"%{b:02X}" for b in c.encode()) for c in v)
    if any(c in v for c in ',;="'):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return v


@dataclass(frozen=True)
class ClientCert:
    """A verified client certificate, as the backend, the limiter and the access log see it (made
    once per connection)."""

    hash: str  # SHA-256 of the DER, hex (a reissued certificate has a new one)
    subject: str  # RFC 2253 text, most specific first ("CN=partner-a,O=Example"): the limiter's key
    uris: tuple[str, ...]
    dns: tuple[str, ...]
    xfcc: bytes  # its X-Forwarded-Client-Cert value


def xfcc(hash_: str, subject: str, uris, dns) -> bytes:
    """Envoy's X-Forwarded-Client-Cert element: Hash=..;Subject="..";URI=..;DNS=.. (the subject always
    quoted, a quote or backslash in it escaped)."""
    subject = subject.replace("\\", "\\\\").replace('"', '\\"')
    parts = [f"Hash={hash_}", f'Subject="{subject}"']
    parts += [f"URI={_element(u)}" for u in uris]
    parts += [f"DNS={_element(d)}" for d in dns]
    return ";".join(parts).encode("ascii")


def client_cert(tsock: ssl.SSLSocket) -> ClientCert | None:
    """The peer's certificate after a handshake that verified it; None when it sent none."""
    der = tsock.getpeercert(binary_form=True)
    if not der:
        return None
    info: dict[str, Any] = tsock.getpeercert() or {}  # each key's value has its own shape
    subject = ",".join(
        "+".join(f"{_RDN.get(k, k)}={_rfc2253(v)}" for k, v in rdn) for rdn in reversed(info.get("subject", ()))
    )
    san = info.get("subjectAltName", ())
    uris = tuple(v for k, v in san if k == "URI")
    dns = tuple(v for k, v in san if k == "DNS")
    h = hashlib.sha256(der).hexdigest()
    return ClientCert(h, subject, uris, dns, xfcc(h, subject, uris, dns))


# The listener's context made by the supervisor before it forks the workers (lb/process/supervisor.py): each
# worker starts with a copy of the same SSL_CTX, so of the same session-ticket keys, and a client's
# ticket is good at every worker. The standard library cannot set ticket keys, so a worker's reload
# (a new context, new keys) ends that sharing: after a SIGHUP a ticket resumes at its own worker only.
inherited: ssl.SSLContext | None = None


def take_inherited() -> ssl.SSLContext | None:
    global inherited
    ctx, inherited = inherited, None
    return ctx


def accept(ctx: ssl.SSLContext, sock: socket.socket, deadline: float) -> tuple[ssl.SSLSocket | None, str]:
    """Complete the server handshake before `deadline`: (the TLS socket, "") or (None, why not).

    A connection whose first byte is not a TLS handshake record is not TLS: plain HTTP sent to the
    HTTPS port ("plain-http"; the caller answers 400 in plain text, as nginx's 497 does).
    """
    try:
        sock.settimeout(max(0.001, deadline - monotonic()))
        first = sock.recv(1, socket.MSG_PEEK)
    except socket.timeout:
        return None, "no TLS handshake in time"
    except OSError as e:
        return None, e.strerror or type(e).__name__
    if not first:
        return None, "closed before the handshake"
    if first[0] != HANDSHAKE:
        return None, "plain-http"
    tls = ctx.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
    try:
        tls.settimeout(max(0.001, deadline - monotonic()))
        tls.do_handshake()
        return tls, ""
    except socket.timeout:
        why = "TLS handshake not completed in time"
    except ssl.SSLError as e:
        why = "TLS handshake failed: " + (e.reason or str(e)).replace("_", " ").lower()
        verify = getattr(e, "verify_message", None)
        if verify:  # a client certificate: expired, revoked, unknown CA
            why += f" ({verify})"
    except OSError as e:
        why = "TLS handshake failed: " + (e.strerror or type(e).__name__)
    tls.close()
    return None, why


def close(tls: ssl.SSLSocket) -> None:
    """Send close_notify without waiting for the peer's (nginx does the same), then close."""
    try:
        tls.setblocking(False)
        tls.unwrap()
    except (OSError, ValueError):
        pass
    tls.close()
