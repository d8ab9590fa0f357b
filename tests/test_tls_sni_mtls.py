"""SNI and mutual TLS against real tools: openssl s_client picks names, curl presents client
certificates (good, none, expired, revoked), the identity backend shows what it received."""

import datetime
import hashlib
import json
import re
import shutil
import signal
import ssl
import subprocess

import pytest

from tests.support import PY, ROOT, Edge, wait_until

trustme = pytest.importorskip("trustme", reason="trustme (requirements-dev.txt) makes the test certificates")
x509 = pytest.importorskip("cryptography.x509", reason="cryptography (trustme's) makes the CRL")
pytestmark = pytest.mark.skipif(not (shutil.which("openssl") and shutil.which("curl")),
                                reason="needs the openssl and curl commands")

PAST = datetime.datetime(2020, 1, 1, tzinfo=datetime.timezone.utc)


def _write(d, name, pem) -> str:
    p = d / name
    pem.write_to_path(str(p))
    return str(p)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A server CA with a default, an exact-name and a wildcard certificate; a client CA with two partners,
    an expired one and one to revoke; its CRLs (empty, and revoking that one)."""
    d = tmp_path_factory.mktemp("pki")
    f = {}
    ca = trustme.CA()
    f["ca"] = _write(d, "ca.pem", ca.cert_pem)
    for name, ids, extra in (("default", ("127.0.0.1", "localhost"), {}),
                             ("api", ("api.example.com", "api2.example.com"), {}),
                             ("wild", ("*.example.com",), {}),
                             ("api-dup", ("api.example.com",), {}),
                             ("old", ("old.example.com",), {"not_before": PAST - datetime.timedelta(days=30),
                                                             "not_after": PAST})):
        leaf = ca.issue_cert(*ids, common_name=name, **extra)
        f[name] = _write(d, f"{name}.pem", leaf.cert_chain_pems[0])
        f[name + "-key"] = _write(d, f"{name}-key.pem", leaf.private_key_pem)
    cca = trustme.CA()
    f["client-ca"] = _write(d, "client-ca.pem", cca.cert_pem)
    serials = {}
    for name, extra in (("partner-a", {}), ("partner-b", {}), ("revoked", {}),
                        ("expired", {"not_before": PAST - datetime.timedelta(days=30), "not_after": PAST})):
        leaf = cca.issue_cert(f"{name}.partners.example", common_name=name, **extra)
        f[name] = _write(d, f"{name}.pem", leaf.cert_chain_pems[0])
        f[name + "-key"] = _write(d, f"{name}-key.pem", leaf.private_key_pem)
        serials[name] = x509.load_pem_x509_certificate(leaf.cert_chain_pems[0].bytes()).serial_number
    f["crl-empty"] = str(d / "crl-empty.pem")
    f["crl-revoked"] = str(d / "crl-revoked.pem")
    _crl(cca, [], f["crl-empty"])
    _crl(cca, [serials["revoked"]], f["crl-revoked"])
    return f


def _crl(ca, serials, path):
    from cryptography.hazmat.primitives import hashes, serialization
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem.bytes())
    key = serialization.load_pem_private_key(ca.private_key_pem.bytes(), password=None)
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateRevocationListBuilder().issuer_name(ca_cert.subject)
         .last_update(now - datetime.timedelta(days=1)).next_update(now + datetime.timedelta(days=30)))
    for s in serials:
        b = b.add_revoked_certificate(x509.RevokedCertificateBuilder().serial_number(s)
                                      .revocation_date(now - datetime.timedelta(hours=1)).build())
    with open(path, "wb") as out:
        out.write(b.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))


def toml_edge(tmp_path, backend, pki, tls_lines: str, *args, name="edge.toml"):
    conf = tmp_path / name
    conf.write_text(f'[[backends]]\nurl = "{backend.url}"\n\n[health]\ninterval = 30\n\n'
                    f'[tls]\ncert = "{pki["default"]}"\nkey = "{pki["default-key"]}"\n{tls_lines}\n')
    return Edge("--config", str(conf), *args), conf


def certificates(*names, pki) -> str:
    return "".join(f'\n[[tls.certificates]]\ncert = "{pki[n]}"\nkey = "{pki[n + "-key"]}"\n' for n in names)


def served(port, servername=None) -> str | None:
    """The CN of the certificate openssl s_client is served for this server name (None: no handshake)."""
    args = ["openssl", "s_client", "-connect", f"127.0.0.1:{port}", "-verify_quiet"]
    args += ["-servername", servername] if servername else ["-noservername"]
    p = subprocess.run(args, input=b"", capture_output=True, timeout=20)
    m = re.search(rb"^subject=.*CN ?= ?([\w-]+)", p.stdout, re.M)
    return m.group(1).decode() if m else None


def test_sni_exact_before_wildcard_case_insensitive_default_for_unknown_and_absent(backend, pki, tmp_path):
    e, _ = toml_edge(tmp_path, backend, pki, "" + certificates("wild", "api", pki=pki))
    try:
        assert served(e.port, "api.example.com") == "api"       # exact beats the wildcard listed before it
        assert served(e.port, "API2.Example.COM") == "api"      # case-insensitive
        assert served(e.port, "www.example.com") == "wild"
        assert served(e.port, "a.b.example.com") == "default"   # a wildcard covers one label only
        assert served(e.port, "other.test") == "default"
        assert served(e.port, None) == "default"
        # ... and the chosen context still speaks HTTP (ALPN h2 then http/1.1 on every context: HTTP/2 here)
        p = subprocess.run(["curl", "-sS", "--cacert", pki["ca"], "--resolve", f"api.example.com:{e.port}:127.0.0.1",
                            "-w", "%{http_version}", "-o", "/dev/null", f"https://api.example.com:{e.port}/"],
                           capture_output=True, text=True, timeout=20)
        assert p.returncode == 0 and p.stdout == "2", p.stderr
        # ... and a session from it resumes (the tickets are the listener's, whichever certificate served)
        import socket
        ctx, session, seen = ssl.create_default_context(cafile=pki["ca"]), None, []
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", e.port), timeout=10) as s:
                with ctx.wrap_socket(s, server_hostname="api.example.com", session=session) as t:
                    t.sendall(b"GET / HTTP/1.1\r\nHost: api.example.com\r\nConnection: close\r\n\r\n")
                    while t.recv(65536):
                        pass
                    seen.append((t.session_reused, dict(x[0] for x in t.getpeercert()["subject"])["commonName"]))
                    session = t.session
        assert seen == [(False, "api"), (True, "api"), (True, "api")], seen
    finally:
        e.stop()


def test_strict_sni_refuses_unknown_and_absent_names(backend, pki, tmp_path):
    e, _ = toml_edge(tmp_path, backend, pki, "strict_sni = true\n" + certificates("api", pki=pki))
    try:
        assert served(e.port, "api.example.com") == "api"
        assert served(e.port, "localhost") == "default"         # the default certificate's own names serve
        assert served(e.port, "other.test") is None
        assert served(e.port, None) is None
        e.wait_log(r"TLS handshake failed")
    finally:
        e.stop()


def test_sighup_reloads_the_set_and_a_broken_pair_keeps_the_old_set(backend, pki, tmp_path):
    cert, key = tmp_path / "sni.pem", tmp_path / "sni-key.pem"
    cert.write_bytes(open(pki["api"], "rb").read())
    key.write_bytes(open(pki["api-key"], "rb").read())
    e, _ = toml_edge(tmp_path, backend, pki, f'\n[[tls.certificates]]\ncert = "{cert}"\nkey = "{key}"\n')
    try:
        assert served(e.port, "api.example.com") == "api" and served(e.port, "www.example.com") == "default"
        cert.write_bytes(open(pki["wild"], "rb").read())
        key.write_bytes(open(pki["wild-key"], "rb").read())
        e.signal(signal.SIGHUP)
        e.wait_log(r"reloaded:")
        assert served(e.port, "www.example.com") == "wild"
        cert.write_bytes(open(pki["api"], "rb").read())       # with the wildcard's key: broken
        e.signal(signal.SIGHUP)
        m = e.wait_log(r"reload rejected.*\n")
        assert "key does not match the certificate" in m.group(0)
        assert served(e.port, "www.example.com") == "wild"    # the old set serves on
    finally:
        e.stop()


def test_check_reports_duplicate_names_and_expired_certificates(backend, pki, tmp_path):
    conf = tmp_path / "check.toml"
    conf.write_text(f'[[backends]]\nurl = "{backend.url}"\n[tls]\ncert = "{pki["default"]}"\n'
                    f'key = "{pki["default-key"]}"\n' + certificates("api", "api-dup", "old", pki=pki))
    p = subprocess.run([PY, "edge.py", "--config", str(conf), "--check"], cwd=ROOT, capture_output=True,
                       text=True, timeout=20)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 2, lines
    assert any("old.pem: expired" in x for x in lines)
    assert any(f"api.example.com: {pki['api']} and {pki['api-dup']} both claim" in x for x in lines)


def curl(port, pki, client=None, *extra, path="/echo"):
    args = ["curl", "-sS", "--cacert", pki["ca"], *extra, f"https://127.0.0.1:{port}{path}"]
    if client:
        args[2:2] = ["--cert", pki[client], "--key", pki[client + "-key"]]
    return subprocess.run(args, capture_output=True, text=True, timeout=20)


def seen_headers(p) -> dict:
    assert p.returncode == 0, p.stderr
    return {k.lower(): v for k, v in json.loads(p.stdout)["headers"]}


def der_sha256(path) -> str:
    return hashlib.sha256(ssl.PEM_cert_to_DER_cert(open(path).read())).hexdigest()


def test_mtls_require_refuses_no_expired_and_revoked_certificates_and_forwards_the_identity(backend, pki, tmp_path):
    crl = tmp_path / "crl.pem"
    crl.write_bytes(open(pki["crl-empty"], "rb").read())
    e, _ = toml_edge(tmp_path, backend, pki, f'client_crl = "{crl}"\n', "--tls-client-ca", pki["client-ca"],
                     "--admin", "127.0.0.1:0")
    try:
        h = seen_headers(curl(e.port, pki, "partner-a", "-H", "X-Forwarded-Client-Cert: Hash=forged"))
        xfcc = h["x-forwarded-client-cert"]
        assert xfcc.startswith(f"Hash={der_sha256(pki['partner-a'])};Subject=\"CN=partner-a,"), xfcc
        assert xfcc.endswith(";DNS=partner-a.partners.example") and "forged" not in xfcc
        for who in (None, "expired"):
            p = curl(e.port, pki, who)
            assert p.returncode != 0 and not p.stdout, (who, p.stdout)
        e.wait_log(r"TLS handshake failed: peer did not return a certificate")
        e.wait_log(r"TLS handshake failed: certificate verify failed \(certificate has expired\)")
        assert seen_headers(curl(e.port, pki, "revoked"))["x-forwarded-client-cert"]
        # Revoked now: the new CRL is read on SIGHUP.
        crl.write_bytes(open(pki["crl-revoked"], "rb").read())
        e.signal(signal.SIGHUP)
        e.wait_log(r"reloaded:")
        p = curl(e.port, pki, "revoked")
        assert p.returncode != 0 and not p.stdout
        e.wait_log(r"certificate verify failed \(certificate revoked\)")
        assert "x-forwarded-client-cert" in seen_headers(curl(e.port, pki, "partner-b"))
        from tests.support import request
        metrics = request(e.admin_port, "GET", "/metrics").body.decode()
        assert re.search(r'^lb_tls_client_certs_total\{client_cert="yes",subject="other"\} [3-9]', metrics,
                         re.M), metrics
    finally:
        e.stop()


def test_mtls_optional_serves_clients_without_a_certificate_unidentified(backend, pki, tmp_path):
    e, _ = toml_edge(tmp_path, backend, pki, f'client_ca = "{pki["client-ca"]}"\nclient_auth = "optional"\n')
    try:
        h = seen_headers(curl(e.port, pki, None, "-H", "X-Forwarded-Client-Cert: Hash=forged;Subject=\"CN=partner-a\""))
        assert "x-forwarded-client-cert" not in h
        assert "CN=partner-b" in seen_headers(curl(e.port, pki, "partner-b"))["x-forwarded-client-cert"]
        p = curl(e.port, pki, "expired")                 # a certificate that does not verify: still refused
        assert p.returncode != 0 and not p.stdout
    finally:
        e.stop()


def test_a_client_forged_x_forwarded_client_cert_never_reaches_a_backend_without_tls(backend):
    from tests.support import request
    e = Edge("--backends", backend.url, "--health-interval", "30")
    try:
        r = request(e.port, "GET", "/echo", {"X-Forwarded-Client-Cert": "Hash=00;Subject=\"CN=admin\""})
        assert "x-forwarded-client-cert" not in {k.lower() for k, _ in json.loads(r.body)["headers"]}
    finally:
        e.stop()


def test_a_client_cert_rule_limits_one_partner_and_not_another(backend, pki, tmp_path):
    log = tmp_path / "access.log"
    rules = '\n[[rules]]\nname = "per-partner"\nkey = "client-cert"\nlimit = "2/m"\n'
    e, conf = toml_edge(tmp_path, backend, pki, f'client_ca = "{pki["client-ca"]}"\nclient_auth = "optional"\n'
                        + rules, "--access-log", str(log))
    try:
        codes = lambda who: [curl(e.port, pki, who, "-o", "/dev/null", "-w", "%{http_code}").stdout
                             for _ in range(3)]
        assert codes("partner-a") == ["200", "200", "429"]
        assert codes("partner-b") == ["200", "200", "429"]       # a bucket of its own
        assert codes(None) == ["200", "200", "429"]              # no certificate: keyed by its address
        wait_until(lambda: log.read_text().count("\n") >= 9, what="nine access-log lines")
        lines = log.read_text().splitlines()
        assert sum("cert=CN=partner-a," in x for x in lines) == 3
        assert sum(" 429 " in x and "cert=CN=partner-b," in x for x in lines) == 1
        assert sum("cert=" not in x for x in lines) == 3
    finally:
        e.stop()


def test_workers_share_session_ticket_keys_a_ticket_resumes_at_either_worker(backend, pki):
    """The supervisor makes the context before it forks: one set of ticket keys. Each worker making its
    own (as before) resumed ~half of these (a connection lands on either worker): 19 of 19 by chance is
    2 in a million."""
    import socket
    e = Edge("--backends", backend.url, "--health-interval", "30", "--workers", "2", "--cpu-affinity", "off",
             "--tls-cert", pki["default"], "--tls-key", pki["default-key"])
    try:
        e.wait_log(r"all 2 workers ready")
        ctx = ssl.create_default_context(cafile=pki["ca"])
        session, resumed = None, []
        for _ in range(20):
            with socket.create_connection(("127.0.0.1", e.port), timeout=10) as s:
                with ctx.wrap_socket(s, server_hostname="127.0.0.1", session=session) as t:
                    t.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    while t.recv(65536):       # the TLS 1.3 tickets come after the handshake
                        pass
                    resumed.append(t.session_reused)
                    session = t.session
        assert resumed == [False] + [True] * 19, resumed
    finally:
        e.stop()


def test_a_rule_matched_on_one_client_cert_subject_limits_that_partner_only(backend, pki, tmp_path):
    subject = re.search(r'Subject="([^"]+)"', seen_headers_of(backend, pki, tmp_path)).group(1)
    rules = (f'\n[[rules]]\nname = "partner-a-only"\nkey = "global"\nlimit = "1/m"\n'
             f'match = {{ client_cert_subject = "{subject.upper()}" }}\n')
    e, _ = toml_edge(tmp_path, backend, pki, f'client_ca = "{pki["client-ca"]}"\nclient_auth = "optional"\n'
                     + rules, "--admin", "127.0.0.1:0", name="match.toml")
    try:
        codes = lambda who: [curl(e.port, pki, who, "-o", "/dev/null", "-w", "%{http_code}").stdout
                             for _ in range(2)]
        assert codes("partner-a") == ["200", "429"]              # the subject compared case-insensitively
        assert codes("partner-b") == ["200", "200"]
        assert codes(None) == ["200", "200"]
        # the metric names the subject a rule names, and no other (bounded labels)
        from tests.support import request
        metrics = request(e.admin_port, "GET", "/metrics").body.decode()
        assert f'client_cert="yes",subject="{subject.lower().replace(chr(92), chr(92) * 2)}"}} 2' in metrics, metrics
        assert 'client_cert="yes",subject="other"} 2' in metrics
        assert 'lb_tls_client_certs_total{client_cert="no"} 2' in metrics
    finally:
        e.stop()


def seen_headers_of(backend, pki, tmp_path) -> str:
    """partner-a's X-Forwarded-Client-Cert, as an edge with mutual TLS sends it."""
    e, _ = toml_edge(tmp_path, backend, pki, f'client_ca = "{pki["client-ca"]}"\n', name="peek.toml")
    try:
        return seen_headers(curl(e.port, pki, "partner-a"))["x-forwarded-client-cert"]
    finally:
        e.stop()


@pytest.mark.parametrize("tls,needle", [
    ('[[tls.certificates]]\ncert = "API"\n', "tls.certificates[0]: missing key"),
    ('[[tls.certificates]]\ncert = "API"\nkey = "API-KEY"\nchain = "x"\n', "tls.certificates[0]: unknown key 'chain'"),
    ('[[tls.certificates]]\ncert = "/nonexistent/a.pem"\nkey = "API-KEY"\n', "tls: cannot read /nonexistent/a.pem: No such file or directory (set by tls.certificates[0].cert"),
    ('[[tls.certificates]]\ncert = "API"\nkey = "WILD-KEY"\n', "key does not match the certificate"),
    ('client_ca = "CLIENT-CA"\nclient_auth = "maybe"\n', "tls.client_auth: 'maybe' is not one of require, optional"),
    ('client_auth = "optional"\n', "tls.client_auth: needs tls.client_ca"),
    ('client_crl = "CRL-EMPTY"\n', "tls.client_crl: needs tls.client_ca"),
    ('client_ca = "API-KEY"\n', "tls.client_ca: cannot use"),
    ('client_ca = "/nonexistent/ca.pem"\n', "tls.client_ca: cannot read /nonexistent/ca.pem"),
    ('strict_sni = 1\n', "tls.strict_sni: expected true or false"),
])
def test_bad_sni_and_mtls_configuration_exits_2_with_one_line(pki, tmp_path, tls, needle):
    from tests.support import config_error
    for name in ("client-ca", "crl-empty", "wild-key", "api-key", "api"):   # longest first: API-KEY before API
        tls = tls.replace(f'"{name.upper()}"', f'"{pki[name]}"')
    conf = tmp_path / "bad.toml"
    # [tls] keys before the [[tls.certificates]] tables, as TOML needs
    head, _, tables = tls.partition("[[")
    conf.write_text(f'[[backends]]\nurl = "http://127.0.0.1:1"\n[tls]\ncert = "{pki["default"]}"\n'
                    f'key = "{pki["default-key"]}"\n{head}' + (f"[[{tables}" if tables else ""))
    assert needle in config_error("--config", str(conf))


def test_sni_and_mtls_keys_need_the_default_certificate(pki, tmp_path):
    from tests.support import config_error
    conf = tmp_path / "nodefault.toml"
    conf.write_text(f'[[backends]]\nurl = "http://127.0.0.1:1"\n[tls]\nclient_ca = "{pki["client-ca"]}"\n')
    assert "need the default certificate" in config_error("--config", str(conf))


def test_a_certificate_chosen_by_sni_still_requires_the_client_certificate(backend, pki, tmp_path):
    """The switched-to context must verify clients as the default does (OpenSSL reads the verify mode from
    the first context and the CA store from the second): no certificate, no handshake, whatever the name."""
    e, _ = toml_edge(tmp_path, backend, pki, f'client_ca = "{pki["client-ca"]}"\n' + certificates("api", pki=pki))
    try:
        sni = ["--resolve", f"api.example.com:{e.port}:127.0.0.1"]
        url = f"https://api.example.com:{e.port}/echo"
        base = ["curl", "-sS", "--cacert", pki["ca"], *sni, url]
        p = subprocess.run(base, capture_output=True, text=True, timeout=20)
        assert p.returncode != 0 and not p.stdout, p.stdout
        p = subprocess.run(base[:2] + ["--cert", pki["partner-a"], "--key", pki["partner-a-key"]] + base[2:],
                           capture_output=True, text=True, timeout=20)
        assert "CN=partner-a," in seen_headers(p)["x-forwarded-client-cert"]
        p = subprocess.run(base[:2] + ["--cert", pki["expired"], "--key", pki["expired-key"]] + base[2:],
                           capture_output=True, text=True, timeout=20)
        assert p.returncode != 0 and not p.stdout
        assert served(e.port, "api.example.com") == "api"       # (s_client sends no client certificate,
    finally:                                                     # and still sees the server's first)
        e.stop()


def test_the_json_access_log_names_the_client_certificate_subject(backend, pki, tmp_path):
    log = tmp_path / "access.json"
    e, _ = toml_edge(tmp_path, backend, pki, f'client_ca = "{pki["client-ca"]}"\nclient_auth = "optional"\n',
                     "--access-log", str(log), "--access-log-format", "json", name="json.toml")
    try:
        assert curl(e.port, pki, "partner-b").returncode == 0
        assert curl(e.port, pki, None).returncode == 0
        wait_until(lambda: log.read_text().count("\n") >= 2, what="two access-log lines")
        with_cert, without = [json.loads(x) for x in log.read_text().splitlines()]
        assert with_cert["client_cert"].startswith("CN=partner-b,"), with_cert
        assert "client_cert" not in without
    finally:
        e.stop()
