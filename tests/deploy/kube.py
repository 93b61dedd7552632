"""A real Kubernetes API server for tests: Debian's etcd + kube-apiserver 1.20.2, no nodes.

    etcd (loopback, temp data dir)  <-  kube-apiserver (127.0.0.1:<free>, RBAC, token auth)
                                          ^ admin: static token, group system:masters
                                          ^ service accounts: TokenRequest tokens

Good for what the API server itself decides: storage, validation, admission, RBAC, the
scale subresource. Nothing runs pods (no kubelet, no controller-manager). Each process runs
in its own process group, dies with this process (PR_SET_PDEATHSIG) and is killed as a
group on stop(). The binaries come from scripts/ensure-kube.sh.
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parents[2]
ENSURE_KUBE = REPO / "scripts" / "ensure-kube.sh"
SERVICE_CIDR = "10.96.0.0/28"
READY_TIMEOUT_S = 90.0


class KubeUnavailable(RuntimeError):
    """The binaries are missing or a process did not come up (the message says why)."""


def ensure_kube_bin() -> Path:
    """Run scripts/ensure-kube.sh (instant once built) and return its bin directory."""
    env_dir = os.environ.get("TANDEM_KUBE_BIN")
    if env_dir:
        return Path(env_dir)
    proc = subprocess.run(["bash", str(ENSURE_KUBE)], capture_output=True, text=True, timeout=3600)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise KubeUnavailable(
            f"{ENSURE_KUBE} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
        )
    bin_dir = Path(lines[-1])
    if not (bin_dir / "kube-apiserver").is_file():
        raise KubeUnavailable(f"{ENSURE_KUBE} printed {bin_dir}, which has no kube-apiserver")
    return bin_dir


def free_ports(num: int) -> list[int]:
    """`num` distinct loopback ports free right now (all held open while choosing)."""
    socks = [socket.socket() for _ in range(num)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def _die_with_parent() -> None:
    # In the child between fork and exec: a SIGKILLed test run leaves no servers behind.
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _spawn(argv: list[str], log: IO[bytes]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group, killed as one in stop()
        preexec_fn=_die_with_parent,
    )


def _kill_group(proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
    try:  # stragglers of the group, even when the leader already exited
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def kubeconfig_yaml(server: str, ca_file: Path, user: str, token: str, namespace: str) -> str:
    """A one-context kubeconfig that authenticates with a bearer token."""
    import yaml

    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "test", "cluster": {"server": server, "certificate-authority": str(ca_file)}}
        ],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [
            {"name": user, "context": {"cluster": "test", "user": user, "namespace": namespace}}
        ],
        "current-context": user,
    }
    return yaml.safe_dump(config, sort_keys=False)


class KubeCluster:
    """etcd + kube-apiserver in `workdir`. Use as a context manager, or start()/stop()."""

    def __init__(self, workdir: Path, bin_dir: Path) -> None:
        self.workdir = workdir
        self.bin_dir = bin_dir
        self.admin_token = secrets.token_hex(16)
        self.port = 0
        self.server = ""
        self.ca_file = workdir / "certs" / "apiserver.crt"
        self.admin_kubeconfig = workdir / "admin.kubeconfig"
        self._procs: list[subprocess.Popen[bytes]] = []
        self._logs: list[IO[bytes]] = []

    def __enter__(self) -> KubeCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- processes --------------------------------------------------------------------------

    def start(self) -> None:
        etcd = shutil.which("etcd")
        if etcd is None:
            raise KubeUnavailable("no etcd on PATH (Debian: apt-get install etcd-server)")
        apiserver = self.bin_dir / "kube-apiserver"
        if not os.access(apiserver, os.X_OK):
            raise KubeUnavailable(f"{apiserver} is missing (run scripts/ensure-kube.sh)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            etcd_url = self._start_etcd(etcd)
            self._start_apiserver(apiserver, etcd_url)
        except BaseException:
            self.stop()
            raise
        self.admin_kubeconfig.write_text(
            kubeconfig_yaml(self.server, self.ca_file, "admin", self.admin_token, "default")
        )

    def stop(self) -> None:
        for proc in reversed(self._procs):  # API server first, then etcd
            _kill_group(proc)
        self._procs.clear()
        for log in self._logs:
            log.close()
        self._logs.clear()

    def _log(self, name: str) -> IO[bytes]:
        log = open(self.workdir / f"{name}.log", "wb")  # closed in stop()
        self._logs.append(log)
        return log

    def log_tail(self, name: str, num_bytes: int = 4000) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_bytes()[-num_bytes:].decode(errors="replace") if path.exists() else ""

    def _start_etcd(self, etcd: str) -> str:
        client, peer = free_ports(2)
        client_url, peer_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
        argv = [
            etcd,
            "--name=test",
            f"--data-dir={self.workdir / 'etcd'}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=test={peer_url}",
            "--log-level=warn",
        ]
        proc = _spawn(argv, self._log("etcd"))
        self._procs.append(proc)
        self._wait("etcd", proc, lambda: _http_ok(f"{client_url}/health", b'"health":"true"'))
        return client_url

    def _start_apiserver(self, apiserver: Path, etcd_url: str) -> None:
        certs = self.workdir / "certs"
        certs.mkdir(exist_ok=True)
        sa_key = self.workdir / "sa.key"
        _make_rsa_key(sa_key)
        tokens = self.workdir / "tokens.csv"
        tokens.write_text(f'{self.admin_token},admin,admin-uid,"system:masters"\n')
        tokens.chmod(0o600)
        (self.port,) = free_ports(1)  # etcd's ports are taken by now
        self.server = f"https://127.0.0.1:{self.port}"
        argv = [
            str(apiserver),
            f"--etcd-servers={etcd_url}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={self.port}",
            f"--cert-dir={certs}",
            f"--token-auth-file={tokens}",
            "--authorization-mode=Node,RBAC",
            f"--service-account-key-file={sa_key}",
            f"--service-account-signing-key-file={sa_key}",
            "--service-account-issuer=https://kubernetes.default.svc",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            # No pods run here, so no token controller: do not make pods need token secrets.
            "--disable-admission-plugins=ServiceAccount",
            # The loopback address may not be an Endpoints IP; nothing needs that Service.
            "--endpoint-reconciler-type=none",
            "--profiling=false",
            "--v=0",
        ]
        proc = _spawn(argv, self._log("kube-apiserver"))
        self._procs.append(proc)
        self._wait("kube-apiserver", proc, lambda: _http_ok(f"{self.server}/readyz", b"ok"))

    def _wait(self, name: str, proc: subprocess.Popen[bytes], ready: Any) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise KubeUnavailable(
                    f"{name} exited with {proc.returncode}:\n{self.log_tail(name)}"
                )
            if ready():
                return
            time.sleep(0.2)
        raise KubeUnavailable(f"{name} not ready after {READY_TIMEOUT_S} s:\n{self.log_tail(name)}")

    # -- clients and identities -------------------------------------------------------------

    def api_client(self, kubeconfig: Path | None = None) -> Any:
        """A `kubernetes.client.ApiClient` for a kubeconfig (default: the admin's)."""
        from kubernetes import config

        return config.new_client_from_config(config_file=str(kubeconfig or self.admin_kubeconfig))

    def service_account_kubeconfig(
        self, namespace: str, name: str, path: Path | None = None, expiration_s: int = 3600
    ) -> Path:
        """Mint a token for ServiceAccount namespace/name (TokenRequest API) and write a
        kubeconfig that authenticates as it."""
        from kubernetes import client

        with self.api_client() as api:
            request = client.AuthenticationV1TokenRequest(
                spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=expiration_s)
            )
            response = client.CoreV1Api(api).create_namespaced_service_account_token(
                name, namespace, request
            )
        assert response.status is not None and response.status.token, response
        token = response.status.token
        path = path or self.workdir / f"sa-{namespace}-{name}.kubeconfig"
        path.write_text(kubeconfig_yaml(self.server, self.ca_file, name, token, namespace))
        path.chmod(0o600)
        return path

    def get_json(self, path: str) -> Any:
        """GET an API path as the admin (for group/versions the client library no longer
        has, such as policy/v1beta1)."""
        request = urllib.request.Request(
            self.server + path, headers={"Authorization": f"Bearer {self.admin_token}"}
        )
        context = ssl.create_default_context(cafile=str(self.ca_file))
        with urllib.request.urlopen(request, timeout=10, context=context) as response:
            return json.load(response)


def _make_rsa_key(path: Path) -> None:
    # The API server reads the public half from the same PEM (--service-account-key-file).
    if shutil.which("openssl") is None:
        raise KubeUnavailable("no openssl on PATH (needed for the service-account key pair)")
    subprocess.run(
        ["openssl", "genrsa", "-out", str(path), "2048"], check=True, capture_output=True
    )


def _http_ok(url: str, expect: bytes) -> bool:
    # /readyz is readable anonymously (system:public-info-viewer); the serving certificate is
    # being generated as we poll, so this probe does not verify it.
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with urllib.request.urlopen(url, timeout=2, context=context) as response:
            return response.status == 200 and expect in response.read()
    except (urllib.error.URLError, OSError):
        return False
