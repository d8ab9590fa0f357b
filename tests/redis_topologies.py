"""Real Redis topologies for the tests: a Redis Cluster (redis-cli --cluster create) and a Sentinel-watched
master with a replica and three sentinels.  Every wait polls with a deadline.

redis-server, redis-cli and redis-sentinel are Debian's (./run-tests installs redis-tools and
redis-sentinel when missing); a missing one FAILS the test with a clear line, never skips.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import redis

from tests.redis_server import RedisServer
from tests.support import free_port, wait_until


def _exe(name: str) -> str:
    exe = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None)
    if exe is None:
        pytest.fail(f"{name} not found: install it (Debian: redis-tools / redis-sentinel; ./run-tests does this)",
                    pytrace=False)
    return exe


def cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too."""
    for _ in range(200):
        p = free_port()
        if p + 10000 < 65536:
            try:
                import socket
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p + 10000))
                return p
            except OSError:
                continue
    raise AssertionError("no free port pair P, P+10000 for a cluster node")


class Cluster:
    """`masters` masters with `replicas` replicas each, node timeout `node_timeout_ms`."""

    def __init__(self, masters: int = 3, replicas: int = 1, node_timeout_ms: int = 1000):
        self.servers: list[RedisServer] = []
        for _ in range(masters * (1 + replicas)):
            s = RedisServer(port=cluster_port(), extra=(
                "--cluster-enabled", "yes", "--cluster-node-timeout", node_timeout_ms,
                "--cluster-config-file", "nodes.conf", "--cluster-replica-validity-factor", "0",
                "--cluster-allow-replica-migration", "no",
                # a dead master's slots must not stop the healthy masters (CLUSTERDOWN for every key
                # until the failover): what an operator who runs a limiter on a cluster sets
                "--cluster-require-full-coverage", "no"), ping={"host": "127.0.0.1"})
            self.servers.append(s.start())
        addrs = [f"127.0.0.1:{s.port}" for s in self.servers]
        p = subprocess.run([_exe("redis-cli"), "--cluster", "create", *addrs, "--cluster-replicas", str(replicas),
                            "--cluster-yes"], capture_output=True, text=True, timeout=60)
        if p.returncode:
            self.stop()
            raise AssertionError(f"redis-cli --cluster create failed:\n{p.stdout}\n{p.stderr}")
        wait_until(self.healthy, timeout=30, interval=0.1, what="the cluster to be ok on every node")
        self.url = f"redis-cluster://127.0.0.1:{self.servers[0].port},127.0.0.1:{self.servers[1].port}"

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=5, decode_responses=True)

    def healthy(self) -> bool:
        try:
            for s in self.alive():
                info = self.client(s.port).cluster("info")
                if info["cluster_state"] != "ok" or int(info["cluster_slots_ok"]) != 16384:
                    return False
            return True
        except redis.RedisError:
            return False

    def alive(self) -> list[RedisServer]:
        return [s for s in self.servers if s.proc.poll() is None]

    def slots(self) -> dict[int, tuple[int, str]]:
        """slot -> (master port, master node id), from the first live node."""
        c = self.client(self.alive()[0].port)
        out = {}
        for start, end, master, *_ in c.execute_command("CLUSTER", "SLOTS"):
            port, node_id = int(master[1]), master[2]
            for slot in range(int(start), int(end) + 1):
                out[slot] = (port, node_id)
        return out

    def node_id(self, port: int) -> str:
        return self.client(port).execute_command("CLUSTER", "MYID")

    def replica_of(self, port: int) -> RedisServer:
        mid = self.node_id(port)
        for s in self.alive():
            info = self.client(s.port).execute_command("ROLE")
            if info[0] == "slave" and int(info[2]) == port:
                return s
        raise AssertionError(f"no replica of {port} ({mid})")

    def server(self, port: int) -> RedisServer:
        return next(s for s in self.servers if s.port == port)

    def stop(self) -> None:
        for s in self.servers:
            s.stop()


class SentinelSet:
    """A master, one replica and three sentinels watching them (quorum 2, down after `down_ms`)."""

    def __init__(self, name: str = "edge-master", down_ms: int = 1000):
        self.name = name
        self.master = RedisServer(ping={"host": "127.0.0.1"}).start()
        self.replica = RedisServer(extra=("--replicaof", "127.0.0.1", self.master_port_at_start()),
                                   ping={"host": "127.0.0.1"}).start()
        self.dir = Path(tempfile.mkdtemp(prefix="sentinel-test-"))
        self.sentinels: list[subprocess.Popen] = []
        self.ports = []
        exe = _exe("redis-sentinel")
        for i in range(3):
            port = free_port()
            conf = self.dir / f"sentinel-{i}.conf"  # sentinel rewrites its file: one each, writable
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {self.dir}\nsentinel resolve-hostnames no\n"
                f"sentinel monitor {name} 127.0.0.1 {self.master.port} 2\n"
                f"sentinel down-after-milliseconds {name} {down_ms}\n"
                f"sentinel failover-timeout {name} 5000\nsentinel parallel-syncs {name} 1\n")
            self.sentinels.append(subprocess.Popen([exe, str(conf), "--loglevel", "warning"],
                                                   stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                                   stdin=subprocess.DEVNULL))
            self.ports.append(port)
        wait_until(self.ready, timeout=30, interval=0.1,
                   what="three sentinels that know each other, the master and its replica")
        self.url = "redis-sentinel://" + ",".join(f"127.0.0.1:{p}" for p in self.ports) + f"/{name}"

    def master_port_at_start(self) -> int:
        return self.master.port

    def sentinel(self, i: int = 0) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.ports[i], socket_timeout=2, decode_responses=True)

    def ready(self) -> bool:
        try:
            for i in range(3):
                m = self.sentinel(i).sentinel_master(self.name)
                if m["num-other-sentinels"] < 2 or m["num-slaves"] < 1:
                    return False
            return self.master.client().info("replication")["connected_slaves"] >= 1
        except redis.RedisError:
            return False

    def current_master(self) -> tuple[str, int]:
        host, port = self.sentinel().sentinel_get_master_addr_by_name(self.name)
        return host, int(port)

    def stop(self) -> None:
        for p in self.sentinels:
            if p.poll() is None:
                p.terminate()
        for p in self.sentinels:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
        self.master.stop()
        self.replica.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
