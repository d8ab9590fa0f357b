"""Defects found by the review of the issue 11-18 landings, each against the real edge: a bad
configuration file that crashed --check, a response cut short by a send timeout left over from the
request head's deadline, an exempt network missed when a trusted proxy writes IPv4-mapped addresses."""

import socket
import subprocess
import time

import pytest

from tests.support import PY, ROOT, Backend, Edge, request, wait_until


@pytest.fixture(scope="module")
def backend():
    b = Backend("rv")
    yield b
    b.stop()


@pytest.mark.parametrize("content, why", [
    (b"listen = \"\xd0\x28\"\n", "not UTF-8"),                       # a binary or Latin-1 file
    (b"x = " + b"[" * 5000 + b"]" * 5000 + b"\n", "nested too deeply"),  # tomllib recurses
], ids=["latin1", "deep"])
def test_check_of_an_unreadable_toml_file_is_one_line_not_a_traceback(tmp_path, content, why):
    path = tmp_path / "edge.toml"
    path.write_bytes(content)
    p = subprocess.run([PY, "edge.py", "--check", "--config", str(path), "--backends", "http://127.0.0.1:1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=30)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and "Traceback" not in p.stderr and len(lines) == 1, p.stderr[-2000:]
    assert f"--config {path}: not valid TOML: {why}" in lines[0]
