"""Every tensor the engine, model and kernels create names its device, checked with `ast`.

A factory call without `device=` lands on the CPU. On a CPU-only CI machine that is
invisible; on a GPU it is a device-mismatch error (or a silent host round trip) in the
middle of a step. So every call of a torch tensor factory in `tandem/engine`, `tandem/model`
and `kernels` must pass `device=` (for `torch.Generator` the first positional argument also
counts). `*_like` functions inherit their input's device and are fine.

A tensor that must stay on the CPU by design (host-side bookkeeping copied to the device
once, a pinned staging buffer) says so on the call's line:

    staging = torch.empty(n, pin_memory=True)  # device: cpu-only (pinned staging buffer)

Keep such opt-outs rare; each one needs its reason in the parentheses.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
CHECKED_DIRS = ("tandem/engine", "tandem/model", "kernels")
FACTORIES = frozenset(
    {
        "tensor",
        "as_tensor",
        "arange",
        "empty",
        "zeros",
        "ones",
        "full",
        "rand",
        "randn",
        "randint",
        "randperm",
        "linspace",
        "eye",
        "empty_strided",
        "Generator",
    }
)
# Only a non-empty reason counts: "# device: cpu-only (host-side block table)".
OPT_OUT = re.compile(r"#\s*device:\s*cpu-only\s*\(\s*[^)\s][^)]*\)")


def _factory_aliases(tree: ast.AST) -> dict[str, str]:
    """Bare names bound by `from torch import zeros [as z]`: alias -> factory."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "torch":
            for alias in node.names:
                if alias.name in FACTORIES:
                    aliases[alias.asname or alias.name] = alias.name
    return aliases


def _factory_name(func: ast.expr, aliases: dict[str, str]) -> str | None:
    """ "zeros" for `torch.zeros` (or a bare alias of it), else None."""
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        if func.value.id == "torch" and func.attr in FACTORIES:
            return func.attr
    if isinstance(func, ast.Name):
        return aliases.get(func.id)
    return None


def _names_device(call: ast.Call, factory: str) -> bool:
    if any(kw.arg == "device" for kw in call.keywords):
        return True
    # torch.Generator(device) takes the device as its only positional argument.
    return factory == "Generator" and bool(call.args)


def unnamed_device_calls(files: Iterable[Path], root: Path) -> list[str]:
    """Tensor factory calls that do not name their device, as "file:line: torch.name".

    A call is exempt when any of its source lines carries the opt-out comment.
    """
    found: list[tuple[str, int, str]] = []
    for path in files:
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines()
        tree = ast.parse(source, filename=str(path))
        aliases = _factory_aliases(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            factory = _factory_name(node.func, aliases)
            if factory is None or _names_device(node, factory):
                continue
            end = node.end_lineno or node.lineno
            if any(OPT_OUT.search(lines[i - 1]) for i in range(node.lineno, end + 1)):
                continue
            found.append((path.relative_to(root).as_posix(), node.lineno, factory))
    return [f"{file}:{line}: torch.{factory}" for file, line, factory in sorted(found)]


def checked_files() -> list[Path]:
    return sorted(p for d in CHECKED_DIRS for p in (REPO_ROOT / d).rglob("*.py"))


def test_every_tensor_factory_names_its_device() -> None:
    files = checked_files()
    # Guard against a moved directory turning this into a check of nothing.
    assert REPO_ROOT / "tandem/engine/sampling.py" in files
    assert REPO_ROOT / "kernels/reference.py" in files
    assert unnamed_device_calls(files, REPO_ROOT) == []


FIXTURE = """\
import torch
from torch import zeros as z


def f(n: int, d: torch.device) -> None:
    torch.arange(n)
    torch.arange(n, device=d)
    torch.arange(n)  # device: cpu-only (host-side index bookkeeping)
    torch.arange(n)  # device: cpu-only ()
    torch.Generator()
    torch.Generator(device=d)
    torch.Generator(d)
    torch.zeros_like(torch.empty(n, device=d))
    torch.full(
        (n,),
        0,
        dtype=torch.long,
    )
    torch.tensor(
        [n],  # device: cpu-only (copied to the device once)
    )
    z(n)
    z(n, device=d)
    torch.nn.functional.pad(torch.ones(n, device=d), (1, 1))
"""


def test_check_reports_exactly_the_planted_calls(tmp_path: Path) -> None:
    module = tmp_path / "pkg" / "planted.py"
    module.parent.mkdir()
    module.write_text(FIXTURE, encoding="utf-8")
    assert unnamed_device_calls([module], tmp_path) == [
        "pkg/planted.py:6: torch.arange",  # no device
        "pkg/planted.py:9: torch.arange",  # an opt-out without a reason does not count
        "pkg/planted.py:10: torch.Generator",
        "pkg/planted.py:14: torch.full",  # a multi-line call is reported at its first line
        "pkg/planted.py:22: torch.zeros",  # a `from torch import` alias
    ]
