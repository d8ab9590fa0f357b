"""TLS termination with the standard library's ssl: the listener's context, and the handshake.

The handshake runs on the connection's own thread under header_timeout (CPython bounds a whole
do_handshake() by the socket timeout, however the ClientHello trickles), so a silent or slow TLS
client holds one thread for at most that long and never delays anyone else's handshake.
"""

from __future__ import annotations

import socket
import ssl
from time import monotonic

from .config import ConfigError

MIN_VERSIONS = {"TLSv1.2": ssl.TLSVersion.TLSv1_2, "TLSv1.3": ssl.TLSVersion.TLSv1_3}
HANDSHAKE = 0x16        # the first byte of every TLS record carrying a ClientHello


def server_context(cert: str, key: str, ciphers: str | None = None, min_version: str = "TLSv1.2"
                   ) -> ssl.SSLContext:
    """A server context for the pair on disk; ConfigError (one line) when it cannot serve."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = MIN_VERSIONS[min_version]     # TLS 1.0/1.1 refused at the handshake
    ctx.options |= ssl.OP_NO_COMPRESSION | ssl.OP_CIPHER_SERVER_PREFERENCE
    # An EOF without close_notify is a close, not an error (HTTP framing, not TLS,
    # detects a truncated request). Without it, OpenSSL 3 answers the EOF the edge itself causes when it
    # shuts the read side of an idle connection (evict_idle, wake_idle) with a decode_error alert: the
    # client saw an SSL error where a clean close (and our close_notify) was meant.
    ctx.options |= getattr(ssl, "OP_IGNORE_UNEXPECTED_EOF", 0)
    ctx.set_alpn_protocols(["http/1.1"])                # we speak HTTP/1.1 only: no h2 offered
    if ciphers:
        try:
            ctx.set_ciphers(ciphers)
        except ssl.SSLError:
            raise ConfigError(f"tls.ciphers: no usable cipher in {ciphers!r}") from None
    for what, path in (("cert", cert), ("key", key)):
        try:                # load_cert_chain's error names no file (None): say which one, and where it is set
            with open(path, "rb"):
                pass
        except OSError as e:
            raise ConfigError(f"tls.{what}: cannot read {path}: {e.strerror or e} (set by --tls-{what} or "
                              f"[tls] {what}: a PEM file the edge's user can read)") from None
    try:
        ctx.load_cert_chain(cert, key)
    except FileNotFoundError as e:
        raise ConfigError(f"tls: cannot read {e.filename}: {e.strerror}") from None
    except PermissionError as e:
        raise ConfigError(f"tls: cannot read {e.filename}: {e.strerror}") from None
    except ssl.SSLError as e:
        why = "the key does not match the certificate" if "KEY_VALUES_MISMATCH" in str(e) else (
            e.reason or str(e)).replace("_", " ").lower()
        raise ConfigError(f"tls: cannot use certificate {cert} with key {key}: {why}") from None
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
