"""Messages name the file or key and the fix (issue 30, item 4): one line each, nothing cascaded, no
"None" where a name belongs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from lb.process.supervisor import exit_reason
from tests.support import Edge, config_error, request


def test_a_missing_tls_file_is_named_with_the_setting_that_names_it(tmp_path):
    line = config_error("--check", "--backends", "http://127.0.0.1:9", "--tls-cert", str(tmp_path / "c.pem"),
                        "--tls-key", str(tmp_path / "k.pem"))
    assert f"tls: cannot read {tmp_path / 'c.pem'}: No such file or directory" in line, line
    assert "--tls-cert" in line and "None" not in line


def test_a_rule_without_a_name_says_it_is_missing_and_how_to_name_it(tmp_path):
    conf = tmp_path / "edge.toml"
    conf.write_text('[[backends]]\nurl = "http://127.0.0.1:9"\n[[rules]]\nkey = "ip"\nlimit = "5/s"\n')
    line = config_error("--check", "--config", str(conf))
    assert "rules[0].name: missing" in line and 'name = "per-ip"' in line and "None" not in line, line


def test_a_toml_syntax_error_is_one_line_without_a_cascade(tmp_path):
    conf = tmp_path / "edge.toml"
    conf.write_text('listen = "127.0.0.1:8080\n[[backends]]\nurl = "http://127.0.0.1:9"\n')
    line = config_error("--check", "--config", str(conf))      # config_error: exactly one line
    assert "not valid TOML" in line and "(at line 1" in line, line


@pytest.mark.parametrize("first, second", [("acme", "acme"), ("acme", "key:acme"), ("10.0.0.1", "ip:10.0.0.1")])
@pytest.mark.parametrize("check", [True, False])
def test_two_overrides_of_one_client_are_an_error_at_check_and_at_start(first, second, check):
    line = config_error(*(["--check"] if check else []), "--listen", "127.0.0.1:0", "--backends",
                        "http://127.0.0.1:9", "--limit", "10/s", "--key-limit", f"{first}=5/s",
                        "--key-limit", f"{second}=7/s")
    assert f"{first!r}=5/s and {second!r}=7/s both set" in line and "keep one" in line, line


def test_the_same_two_overrides_in_the_file_are_an_error_too(tmp_path):
    conf = tmp_path / "edge.toml"
    conf.write_text('[[backends]]\nurl = "http://127.0.0.1:9"\n[limits]\ndefault = "10/s"\n'
                    '[limits.keys]\nacme = "5/s"\n"key:acme" = "7/s"\n')
    assert "both set key:acme's limit" in config_error("--check", "--config", str(conf))


def test_a_reweighted_backend_is_named_in_the_reload_line(backends, tmp_path):
    conf = tmp_path / "edge.toml"
    body = '[[backends]]\nurl = "{a}"\nweight = {w}\n[[backends]]\nurl = "{b}"\n'
    conf.write_text(body.format(a=backends[0].url, b=backends[1].url, w=1))
    e = Edge("--config", str(conf))
    try:
        conf.write_text(body.format(a=backends[0].url, b=backends[1].url, w=3))
        e.signal(signal.SIGHUP)
        e.wait_log(r"reloaded: 2 backends \(0 added, 0 removed, 1 reweighted: " + backends[0].url + r" 1->3\)")
    finally:
        e.stop()


def test_a_worker_killed_by_a_signal_is_logged_by_the_signal_name(backends):
    e = Edge("--backends", backends[0].url, "--workers", "2", "--admin", "127.0.0.1:0")
    try:
        e.wait_log(r"all 2 workers ready", timeout=20)   # killed before that, it "failed to start" instead
        pid = json.loads(request(e.admin_port, "GET", "/status").body)["pid"]
        os.kill(pid, signal.SIGKILL)
        # (whichever worker's admin port the log named first: worker 0's or worker 1's)
        e.wait_log(rf"worker \d \(pid {pid}\) exited \(killed by SIGKILL\); restarting it", timeout=20)
        assert "status -9" not in e.log()
    finally:
        e.stop()


def test_exit_reason_reads_a_real_wait_status():
    p = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    assert exit_reason(os.waitpid(p.pid, 0)[1]) == "status 3"
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    os.kill(p.pid, signal.SIGTERM)
    assert exit_reason(os.waitpid(p.pid, 0)[1]) == "killed by SIGTERM"
