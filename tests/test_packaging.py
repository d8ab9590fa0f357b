"""The project installs as a package: `pip install .` gives an `edge` command, and --version names it."""

from __future__ import annotations

import shutil
import subprocess
import sys

import lb
from tests.support import PY, ROOT


def test_version_flag_prints_the_package_version():
    p = subprocess.run([PY, "edge.py", "--version"], cwd=ROOT, capture_output=True, text=True, timeout=20)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == f"edge {lb.__version__}"


def test_pip_install_gives_an_edge_command_that_runs_from_anywhere(tmp_path):
    # A copy of the tracked files (nothing a local run left behind), installed into a fresh venv that
    # sees this interpreter's packages (urllib3, redis) so nothing but the build backend is fetched.
    src = tmp_path / "src"
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=120)
    pip = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--no-deps", "--disable-pip-version-check",
                          str(src)], capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    edge = venv / "bin" / "edge"
    out = subprocess.run([str(edge), "--version"], cwd=tmp_path, capture_output=True, text=True, timeout=20)
    assert out.stdout.strip() == f"edge {lb.__version__}", out.stderr
    check = subprocess.run([str(edge), "--check", "--backends", "http://127.0.0.1:9"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=20)
    assert check.returncode == 0 and "configuration OK" in check.stdout, check.stdout + check.stderr
    # The Redis stores' Lua scripts are package data: the installed copy reads them from its own files.
    probe = ("import limiter.redis.scripts as s, limiter.redis.shaping, limiter.redis.multi, limiter.concurrency;"
             "print(s.__file__); print(len(list(s.files('limiter.redis').joinpath('lua').iterdir())))")
    out = subprocess.run([str(venv / "bin" / "python"), "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                         timeout=20)
    assert out.returncode == 0, out.stderr
    where, count = out.stdout.split()
    assert where.startswith(str(venv)) and int(count) == len(list((ROOT / "limiter/redis/lua").glob("*.lua"))), out.stdout
