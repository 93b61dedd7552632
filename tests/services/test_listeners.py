"""Under `tandem up`, every socket any of its processes listens on is on loopback, and its
secrets (the Redis password, the cluster secret, the API key with `api_keys`) are on no
command line and in no log.

A real `tandem up` (Redis, router, a prefill and a decode worker on NIXL/UCX, the ratio
controller in the `tandem up` process) serves its demo requests, KV hand-offs included; then
each process's sockets are read from /proc: its socket inodes (/proc/<pid>/fd) matched
against /proc/<pid>/net/{tcp,tcp6,udp,udp6,unix}. Every TCP socket in LISTEN state and every
bound UDP socket must be on 127.0.0.1 or ::1 (or ::ffff:127.0.0.1, an IPv4 loopback address on
a dual-stack socket); no process may listen on an abstract UNIX socket (which anyone in the
network namespace can connect to), and a UNIX socket with a path (Redis) must be closed to
other users.

Not listeners, so not checked: UCX's shared-memory transports bind unconnected abstract
*datagram* sockets (autobind names like @1a2b3) that only carry wake-up signals.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import redis

from tandem.client import TandemClient, TandemError
from tandem.services.up import Cluster, UpConfig, wait_for_router

WAIT_S = 120.0
KV_BYTES = 64 << 20
TCP_LISTEN = "0A"
UNIX_ACCEPTCON = 0x10000  # __SO_ACCEPTCON in /proc/net/unix Flags: a listening socket
LOOPBACK = {
    ipaddress.ip_address("127.0.0.1"),
    ipaddress.ip_address("::1"),
    ipaddress.ip_address("::ffff:127.0.0.1"),
}


@dataclass(frozen=True)
class Listener:
    pid: int
    process: str  # the command line, shortened
    kind: str  # tcp, tcp6, udp, udp6, unix
    address: str  # "127.0.0.1:50051", "[::1]:7", "@abstract", "/path"

    def __str__(self) -> str:
        return f"{self.kind} {self.address} in pid {self.pid} ({self.process})"


def _hex_address(text: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    """/proc/net/{tcp,udp}[6] `local_address`: the address as 32-bit words in host (little
    endian) order, then ':' and the port in hex."""
    addr_hex, port_hex = text.split(":")
    raw = bytes.fromhex(addr_hex)
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return ipaddress.ip_address(socket.inet_ntop(family, raw)), int(port_hex, 16)


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:[") : -1]))
    return inodes


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:100]


def listeners(pid: int) -> list[Listener]:
    """Every listening (TCP LISTEN, bound UDP, accepting UNIX) socket of process `pid`."""
    inodes = _socket_inodes(pid)
    process = _cmdline(pid)
    found = []
    for kind in ("tcp", "tcp6", "udp", "udp6"):
        for line in Path(f"/proc/{pid}/net/{kind}").read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[9]) not in inodes:
                continue
            address, port = _hex_address(fields[1])
            if kind.startswith("tcp") and fields[3] != TCP_LISTEN:
                continue  # a connection, not a listener
            if kind.startswith("udp") and port == 0:
                continue
            shown = f"[{address}]:{port}" if address.version == 6 else f"{address}:{port}"
            found.append(Listener(pid, process, kind, shown))
    for line in Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        # Num RefCount Protocol Flags Type St Inode [Path]
        if int(fields[6]) in inodes and int(fields[3], 16) & UNIX_ACCEPTCON:
            found.append(Listener(pid, process, "unix", fields[7] if len(fields) > 7 else ""))
    return found


def descendants(pid: int) -> list[int]:
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        children = [p for p, pp in parents.items() if pp == parent]
        out += children
        frontier += children
    return out


def not_on_loopback(found: list[Listener]) -> list[Listener]:
    bad = []
    for listener in found:
        if listener.kind == "unix":
            if listener.address.startswith("@"):
                bad.append(listener)
            continue
        host = listener.address.rsplit(":", 1)[0].strip("[]")
        if ipaddress.ip_address(host) not in LOOPBACK:
            bad.append(listener)
    return bad


def test_the_address_parser_reads_proc_net() -> None:
    assert _hex_address("0100007F:1F90") == (ipaddress.ip_address("127.0.0.1"), 8080)
    assert _hex_address("020200C0:0050") == (ipaddress.ip_address("192.0.2.2"), 80)
    v6_loopback = "00000000000000000000000001000000:0035"
    assert _hex_address(v6_loopback) == (ipaddress.ip_address("::1"), 53)
    mapped = "0000000000000000FFFF00000100007F:0001"
    assert _hex_address(mapped) == (ipaddress.ip_address("::ffff:127.0.0.1"), 1)


def test_the_check_sees_a_listener_on_every_interface() -> None:
    """The check itself: this process listening on 0.0.0.0 and on an abstract UNIX socket is
    caught; on 127.0.0.1 it is not."""
    with (
        socket.create_server(("0.0.0.0", 0)) as wide,
        socket.create_server(("127.0.0.1", 0)) as narrow,
        socket.socket(socket.AF_UNIX) as abstract,
    ):
        abstract.bind(f"\0tandem-test-{os.getpid()}")
        abstract.listen()
        bad = {str(b).split(" in pid")[0] for b in not_on_loopback(listeners(os.getpid()))}
        assert f"tcp 0.0.0.0:{wide.getsockname()[1]}" in bad
        assert f"unix @tandem-test-{os.getpid()}" in bad
        assert not any(f":{narrow.getsockname()[1]}" in b for b in bad)


class TandemUp:
    def __init__(self, model_dir: Path, run_dir: Path) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "tandem.services.cli", "up",
                "--model", str(model_dir),
                "--port", "0",
                "--admin-port", "0",
                "--autoscale",
                "--kv-cache-bytes", str(KV_BYTES),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            cwd=run_dir,
        )  # fmt: skip
        self.out: list[str] = []
        self.err: list[str] = []
        for stream, lines in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=lines.extend, args=(stream,), daemon=True).start()

    def serving(self) -> None:
        """Until the demo requests (a KV hand-off among them) are done."""
        deadline = time.monotonic() + WAIT_S
        while not any("Ctrl-C stops every process" in line for line in self.out):
            assert self.proc.poll() is None, "tandem up exited:\n" + "".join(self.err)
            assert time.monotonic() < deadline, "no demo within the wait:\n" + "".join(self.err)
            time.sleep(0.2)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture(scope="module")
def tandem_up(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TandemUp]:
    up = TandemUp(tiny_model_dir, tmp_path_factory.mktemp("up"))
    try:
        up.serving()
        yield up
    finally:
        up.close()


def test_every_listener_of_tandem_up_is_on_loopback(tandem_up: TandemUp) -> None:
    demo = "".join(tandem_up.out)
    assert "KV pulled by" in demo, demo  # the demo's long prompt went through NIXL/UCX
    pids = [tandem_up.proc.pid, *descendants(tandem_up.proc.pid)]
    commands = {pid: _cmdline(pid) for pid in pids}
    for module in (
        "tandem.services.prefill",
        "tandem.services.decode",
        "tandem.services.router",
        "redis-server",
    ):
        if module == "redis-server":
            assert any("valkey-server" in c or "redis-server" in c for c in commands.values())
        else:
            assert any(module in c for c in commands.values()), (module, commands)

    found = [listener for pid in pids for listener in listeners(pid)]
    bad = not_on_loopback(found)
    assert not bad, "listening beyond loopback:\n" + "\n".join(map(str, bad))

    # Each gRPC server, UCX's TCP listener in each worker and the controller's admin API
    # (in the tandem up process) were seen, so the check had something to check.
    by_pid: dict[int, list[Listener]] = {}
    for listener in found:
        by_pid.setdefault(listener.pid, []).append(listener)
    for pid, command in commands.items():
        tcp = [x for x in by_pid.get(pid, []) if x.kind.startswith("tcp")]
        if "tandem.services.prefill" in command or "tandem.services.decode" in command:
            assert len(tcp) >= 2, (command, tcp)  # gRPC + UCX
        elif "tandem.services.router" in command:
            assert len(tcp) >= 1, (command, tcp)
    assert [x for x in by_pid.get(tandem_up.proc.pid, []) if x.kind.startswith("tcp")]

    # Redis listens on a UNIX socket with a path only this user may open.
    sockets = [Path(x.address) for x in found if x.kind == "unix"]
    assert sockets and all(s.name == "redis.sock" for s in sockets), sockets
    for path in sockets:
        assert path.stat().st_mode & 0o077 == 0, oct(path.stat().st_mode)


def test_tandem_up_keeps_its_secrets_off_command_lines_and_logs(tandem_up: TandemUp) -> None:
    pids = descendants(tandem_up.proc.pid)
    services = {
        pid: _cmdline(pid)
        for pid in pids
        if " -m tandem.services." in _cmdline(pid) and "redis" not in _cmdline(pid)
    }
    assert len(services) == 3, services  # router, prefill, decode
    (run_dir,) = {
        line.split("logs in ", 1)[1].strip() for line in tandem_up.err if "logs in " in line
    }
    secret_file = Path(run_dir) / "cluster.secret"

    # The services get the Redis URL (with its password) through the environment.
    environ = dict(
        item.split(b"=", 1)
        for item in Path(f"/proc/{next(iter(services))}/environ").read_bytes().split(b"\0")
        if b"=" in item
    )
    url = environ[b"TANDEM_REDIS_URL"].decode()
    password = url.split("@", 1)[0].rsplit(":", 1)[1]
    assert len(password) >= 32
    for pid in [tandem_up.proc.pid, *pids]:
        assert password.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes(), _cmdline(pid)
    for pid, shown in services.items():
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert args[args.index(b"--cluster-secret-file") + 1] == str(secret_file).encode(), shown
    assert secret_file.stat().st_mode & 0o777 == 0o600
    # Redis has it from a config file only we may read.
    assert (Path(run_dir) / "redis-data" / "auth.conf").stat().st_mode & 0o777 == 0o600
    assert len(bytes.fromhex(secret_file.read_text())) == 32
    for log in Path(run_dir).glob("*.log"):
        text = log.read_text()
        assert password not in text and secret_file.read_text() not in text, log.name

    # Redis wants the password: without it, nothing.
    with redis.Redis.from_url(url) as client:
        assert client.ping()
    unix = "unix://" + url.split("@", 1)[1]
    with redis.Redis.from_url(unix) as client, pytest.raises(redis.AuthenticationError):
        client.ping()


def test_tandem_up_with_api_keys(tiny_model_dir: Path, tmp_path: Path) -> None:
    """UpConfig.api_keys: the router wants the generated key, kept in a file of mode 0600
    (named on the router's command line; the key itself is not)."""
    cluster = Cluster(
        UpConfig(
            model_dir=str(tiny_model_dir),
            dtype="float32",
            port=0,
            http_port=0,
            num_prefill=0,
            kv_cache_bytes=KV_BYTES,
            run_dir=str(tmp_path),
            api_keys=True,
        )
    )
    cluster.start()
    try:
        key = cluster.api_key
        wait_for_router(cluster.router_address, api_key=key)
        keys = tmp_path / "api-keys"
        assert keys.read_text() == f"{key} default\n"
        assert keys.stat().st_mode & 0o777 == 0o600
        for wrong in ("", "x" * 32):  # no key, an unknown key
            with TandemClient(cluster.router_address, api_key=wrong) as client:
                with pytest.raises(TandemError) as exc:
                    client.generate([5, 6], max_tokens=1)
                assert exc.value.code == grpc.StatusCode.UNAUTHENTICATED
        with TandemClient(cluster.router_address, api_key=key) as client:
            assert client.generate([5, 6], max_tokens=2).completion_tokens == 2
        for child in cluster.children:
            assert key.encode() not in Path(f"/proc/{child.proc.pid}/cmdline").read_bytes()
    finally:
        cluster.stop()
    for log in tmp_path.glob("*.log"):
        assert key not in log.read_text(), log.name
