"""Certificates for TLS tests, made with the openssl CLI (tests skip without it)."""

from __future__ import annotations

import subprocess
from pathlib import Path


def _openssl(cwd: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca(cwd: Path, name: str) -> None:
    """{name}.pem and {name}.key: a self-signed CA."""
    _openssl(
        cwd, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
        "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2",
        "-subj", f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
    )  # fmt: skip


def make_cert(cwd: Path, name: str, ca: str) -> None:
    """{name}.pem and {name}.key: a service certificate for 127.0.0.1 (server and client)
    that `ca` signed."""
    (cwd / f"{name}.ext").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n"
        "extendedKeyUsage=serverAuth,clientAuth\n"
    )
    _openssl(
        cwd, "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}",
    )  # fmt: skip
    _openssl(
        cwd, "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
        "-set_serial", str(abs(hash(name)) + 1), "-days", "2", "-out", f"{name}.pem",
        "-extfile", f"{name}.ext",
    )  # fmt: skip
