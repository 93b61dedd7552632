"""`tandem ctl`: watch and tune the ratio controller through its admin API (tandem.v1.Admin).

tandem ctl status                       current/desired/ready workers, host capacity, SLA
                                        attainment, reasons
tandem ctl explain [-n 5]               the last decisions: reasons (clamps, undone
                                        scale-ups) and model figures
tandem ctl set-ratio P D                pin P prefill and D decode workers
tandem ctl set-sla --ttft-p90 MS --itl-p90 MS
tandem ctl auto                         back to automatic control
tandem ctl top [--interval S] [--once]  live view: workers, latency, P:D (q quits)

A controller with admin keys needs one: --admin-key-file PATH (a file holding the key), or
the key in TANDEM_ADMIN_KEY. set-ratio, set-sla and auto need scope "admin"; status,
explain and top "admin" or "read".
"""

from __future__ import annotations

import argparse
import math
import os
import select
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any, TextIO

from tandem.types import Role

DEFAULT_ADDRESS = "127.0.0.1:50061"
ADMIN_KEY_ENV = "TANDEM_ADMIN_KEY"


def admin_key(key_file: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The admin key: the contents of `key_file` (surrounding whitespace stripped), else
    $TANDEM_ADMIN_KEY, else None (a controller without admin keys).

    Raises ValueError when the file is empty or holds more than one word."""
    if key_file:
        words = Path(key_file).read_text(encoding="utf-8").split()
        if len(words) != 1:
            raise ValueError(f"{key_file}: need exactly one key, found {len(words)} words")
        return words[0]
    return environ.get(ADMIN_KEY_ENV, "").strip() or None


def format_capacity(c: Any) -> str:
    """A HostCapacity as one line: what the host holds, what runs, and why."""
    room = c.max_workers - c.num_workers
    more = f"room for {room} more" if room > 0 else "no room to add"
    return f"host: holds {c.max_workers} workers, {c.num_workers} running, {more} ({c.reason})"


def format_status(s: Any) -> str:
    def ms(v: float) -> str:
        return "n/a" if math.isnan(v) else f"{v:.0f} ms"

    attainment = "n/a" if math.isnan(s.sla_attainment) else f"{100 * s.sla_attainment:.1f}%"
    lines = [
        f"mode: {s.mode}    actuator: {s.actuator}    SLA: TTFT p90 <= "
        f"{s.sla.ttft_p90_ms:.0f} ms, ITL p90 <= {s.sla.itl_p90_ms:.0f} ms",
        f"window: {s.window_requests} requests, SLA attainment {attainment}, "
        f"TTFT p90 {ms(s.ttft_p90_ms)}, ITL p90 {ms(s.itl_p90_ms)}",
    ]
    if s.HasField("capacity"):
        lines.append(format_capacity(s.capacity))
    lines += [
        "",
        f"{'role':<8} {'current':>7} {'desired':>7} {'ready':>5} {'live':>4} {'draining':>8}  "
        f"{'bounds':<8} reason",
    ]
    for r in s.roles:
        lines.append(
            f"{r.role:<8} {r.current:>7} {r.desired:>7} {r.ready:>5} {r.live:>4} "
            f"{r.draining:>8}  {f'[{r.min}, {r.max}]':<8} {r.reason}"
        )
    if s.last_error:
        lines.append(f"\nlast error: {s.last_error}")
    return "\n".join(lines)


def format_decisions(resp: Any) -> str:
    if not resp.decisions:
        return "no decisions yet"
    out = []
    for d in resp.decisions:
        when = time.strftime("%H:%M:%S", time.localtime(d.unix_time))
        change = ", ".join(
            f"{role} {d.current[role]}"
            + (f" -> {d.target[role]}" if d.target[role] != d.current[role] else "")
            for role in Role
        )
        state = "" if d.applied else f"  NOT APPLIED: {d.error}"
        out.append(f"{when}  {change}{state}")
        for role in Role:
            out.append(f"    {role}: {d.reasons[role]}")
        if d.figures:
            figs = ", ".join(f"{k}={v:.4g}" for k, v in sorted(d.figures.items()))
            out.append(f"    figures: {figs}")
    return "\n".join(out)


# -- top ---------------------------------------------------------------------------------------

# Redraw in place: cursor home, each line cleared to its end, the rest of the screen cleared.
HOME, CLEAR_EOL, CLEAR_BELOW = "\x1b[H", "\x1b[K", "\x1b[J"
# The alternate screen (the shell's screen comes back on exit), cursor hidden while shown.
ENTER_SCREEN, LEAVE_SCREEN = "\x1b[?1049h\x1b[?25l", "\x1b[?25h\x1b[?1049l"


def _ms(v: float) -> str:
    return "n/a" if math.isnan(v) else f"{v:.0f} ms"


def short_kv_format(kv_format: str) -> str:
    """A worker's KV format as `ctl top` shows it: "fp8/1a2b3c4d" (8 digits of its scales'
    digest), "bfloat16", "-" when the worker does not say."""
    dtype, _, digest = kv_format.partition("/")
    dtype = {"float8_e4m3fn": "fp8"}.get(dtype, dtype)
    return f"{dtype}/{digest[:8]}" if digest else dtype or "-"


def _compact(v: float) -> str:
    """A count or rate in at most ~6 characters: "900", "120.5k", "3.4M"."""
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if v >= scale:
            return f"{v / scale:.1f}{unit}"
    return f"{v:.0f}"


def tier_use(w: Any) -> list[str]:
    """A worker's KV tiers as `ctl top` shows them, in three parts: each tier's verified
    blocks and the prompt tokens per second it brings back ("host 1.2k blk 120.5k/s"; "" for
    a tier it lacks), then the prompt tokens its tiers have served since start ("hits 56.0k");
    [] for a worker without tiers."""
    tiers = (
        ("host", w.host_tier_blocks, w.host_onload_tokens_per_s),
        ("disk", w.disk_tier_blocks, w.disk_onload_tokens_per_s),
    )
    parts = [
        f"{tier} {_compact(blocks)} blk {_compact(rate)}/s" if blocks or rate > 0 else ""
        for tier, blocks, rate in tiers
    ]
    if not any(parts) and not w.tier_hit_tokens:
        return []
    return [*parts, f"hits {_compact(w.tier_hit_tokens)}"]


def render_top(s: Any, address: str, now: float) -> list[str]:
    """The `tandem ctl top` screen for one StatusResponse `s` of the controller at `address`,
    at wall-clock time `now` (lines without escape codes or trailing newlines)."""
    roles = {r.role: r for r in s.roles}
    p, d = roles.get(Role.PREFILL), roles.get(Role.DECODE)

    def ratio(field: str) -> str:
        return f"{getattr(p, field, 0)}:{getattr(d, field, 0)}"

    age = f"{now - s.observed_unix:.0f} s ago" if s.observed_unix else "not yet"
    r = s.recent
    lines = [
        f"tandem ctl top  {address}  {time.strftime('%H:%M:%S', time.localtime(now))}  "
        f"mode {s.mode}  actuator {s.actuator}  observed {age}",
        f"P:D  current {ratio('current')}  wanted {ratio('desired')}  live {ratio('live')}",
    ]
    if s.HasField("capacity"):
        lines.append(format_capacity(s.capacity))
    lines += [f"  {role.role}: {role.reason}" for role in s.roles]
    lines += [
        f"last {r.window_s:.0f} s: {r.requests} requests  TTFT p50 {_ms(r.ttft_p50_ms)} "
        f"p90 {_ms(r.ttft_p90_ms)}  ITL p50 {_ms(r.itl_p50_ms)} p90 {_ms(r.itl_p90_ms)}",
        "",
    ]
    names = [w.worker_id + (" [draining]" if w.draining else "") for w in s.workers]
    width = max([24, *map(len, names)])
    # KV tiers' use, a column only when some worker has a tier: its parts aligned across
    # workers (a part no worker shows takes no room), "-" for a worker without tiers.
    uses = [tier_use(w) for w in s.workers]
    part_widths = [max(len(u[i]) for u in uses if u) for i in range(3)] if any(uses) else []
    tiers = [
        "  ".join(f"{part:<{n}}" for part, n in zip(u, part_widths, strict=True) if n).rstrip()
        if u
        else "-"
        for u in uses
    ]
    kv_width = max([2, *(len(short_kv_format(w.kv_format)) for w in s.workers)])
    tier_head = f"{'KV':<{kv_width}}  TIERS" if any(uses) else "KV"
    lines.append(
        f"{'ROLE':<8} {'WORKER':<{width}} {'WAITING':>7} {'RUNNING':>7} {'KV USED/TOTAL':>18} "
        f"{'STEP':>9} {'TOK/S':>8}  {tier_head}"
    )
    for w, name, tier in zip(s.workers, names, tiers, strict=True):
        used = w.num_blocks - w.num_free_blocks
        share = f"({100 * used / w.num_blocks:.0f}%)" if w.num_blocks else "(-)"
        kv = short_kv_format(w.kv_format)
        kv = f"{kv:<{kv_width}}  {tier}" if tier_head != "KV" else kv
        lines.append(
            f"{w.role:<8} {name:<{width}} {w.num_waiting:>7} {w.num_running:>7} "
            f"{f'{used}/{w.num_blocks} {share}':>18} {f'{w.step_ms:.1f} ms':>9} "
            f"{w.tokens_per_s:>8.0f}  {kv}"
        )
    if not s.workers:
        lines.append("(no workers heartbeating)")
    if s.last_error:
        lines += ["", f"last error: {s.last_error}"]
    return lines


def _fit(lines: list[str], columns: int, rows: int) -> list[str]:
    """Cut the frame to the terminal: a wrapped line would break the in-place redraw."""
    return [line[:columns] for line in lines[:rows]]


def top(
    fetch: Callable[[], Any],
    address: str,
    interval_s: float,
    out: TextIO,
    keys: IO[Any] | None,
    now: Callable[[], float] = time.time,
) -> int:
    """Redraw the status every `interval_s` until `q` is read from `keys` (a terminal in
    cbreak mode, or None: run until interrupted). `fetch` returns a StatusResponse or raises
    grpc.RpcError; an unreachable controller is shown and retried, a refused key ends it."""
    import grpc

    out.write(ENTER_SCREEN)
    try:
        while True:
            try:
                lines = render_top(fetch(), address, now())
            except grpc.RpcError as exc:
                if exc.code() in (
                    grpc.StatusCode.UNAUTHENTICATED,
                    grpc.StatusCode.PERMISSION_DENIED,
                ):
                    raise
                lines = [
                    f"tandem ctl top  {address}",
                    f"cannot reach the controller: {exc.code().name}: {exc.details()} (retrying)",
                ]
            size = shutil.get_terminal_size()
            frame = _fit(lines, size.columns, size.lines - 1)
            out.write(HOME + "".join(line + CLEAR_EOL + "\n" for line in frame))
            out.write("q: quit" + CLEAR_EOL + CLEAR_BELOW)
            out.flush()
            deadline = time.monotonic() + interval_s
            while (left := deadline - time.monotonic()) > 0:
                if keys is None:
                    time.sleep(left)
                    break
                ready, _, _ = select.select([keys], [], [], left)
                if ready:
                    typed = os.read(keys.fileno(), 64)
                    if not typed or b"q" in typed.lower():  # q, Q, or the terminal closed
                        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        out.write(LEAVE_SCREEN)
        out.flush()


def _run_top(args: argparse.Namespace, fetch: Callable[[], Any]) -> int:
    """`top` on this terminal: keys read in cbreak mode (restored on exit); without a
    terminal, or with --once, one plain frame."""
    if not args.interval > 0:
        print(f"error: --interval: need seconds > 0, got {args.interval}", file=sys.stderr)
        return 2
    if args.once or not sys.stdout.isatty():
        print("\n".join(render_top(fetch(), args.address, time.time())))
        return 0
    if not sys.stdin.isatty():
        return top(fetch, args.address, args.interval, sys.stdout, None)
    import termios
    import tty

    saved = termios.tcgetattr(sys.stdin)
    try:
        tty.setcbreak(sys.stdin)
        return top(fetch, args.address, args.interval, sys.stdout, sys.stdin)
    finally:
        termios.tcsetattr(sys.stdin, termios.TCSADRAIN, saved)


def run(args: argparse.Namespace) -> int:
    import grpc

    from tandem.v1 import admin_pb2 as apb
    from tandem.v1 import admin_pb2_grpc as agrpc

    try:
        key = admin_key(args.admin_key_file)
    except (OSError, ValueError) as exc:
        print(f"error: admin key: {exc}", file=sys.stderr)
        return 2
    call: dict[str, Any] = {"timeout": args.timeout}
    if key is not None:
        call["metadata"] = (("authorization", f"Bearer {key}"),)
    with grpc.insecure_channel(args.address) as channel:
        stub = agrpc.AdminStub(channel)
        try:
            if args.action == "top":
                return _run_top(args, lambda: stub.Status(apb.StatusRequest(), **call))
            if args.action == "status":
                print(format_status(stub.Status(apb.StatusRequest(), **call)))
            elif args.action == "explain":
                print(format_decisions(stub.Explain(apb.ExplainRequest(limit=args.n), **call)))
            elif args.action == "set-ratio":
                req = apb.SetRatioRequest(prefill=args.prefill, decode=args.decode)
                print(format_status(stub.SetRatio(req, **call)))
            elif args.action == "set-sla":
                sla = apb.Sla()
                if args.ttft_p90 is not None:
                    sla.ttft_p90_ms = args.ttft_p90
                if args.itl_p90 is not None:
                    sla.itl_p90_ms = args.itl_p90
                print(format_status(stub.SetSla(apb.SetSlaRequest(sla=sla), **call)))
            else:
                print(format_status(stub.Auto(apb.AutoRequest(), **call)))
        except grpc.RpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.UNAVAILABLE:
                print(
                    f"error: cannot reach the controller at {args.address} ({exc.details()}); "
                    "is `tandem up --autoscale` or `python -m tandem.services.controller` running?",
                    file=sys.stderr,
                )
            elif code == grpc.StatusCode.UNAUTHENTICATED and key is None:
                print(
                    f"error: {code.name}: {exc.details()}; pass --admin-key-file or set "
                    f"{ADMIN_KEY_ENV}",
                    file=sys.stderr,
                )
            else:
                print(f"error: {code.name}: {exc.details()}", file=sys.stderr)
            return 2
    return 0


def add_parser(sub: Any) -> None:
    c = sub.add_parser("ctl", help="watch and tune the ratio controller", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    c.add_argument("--address", default=DEFAULT_ADDRESS, help="controller admin API host:port")
    c.add_argument("--timeout", type=float, default=10.0, help="seconds per call")
    c.add_argument(
        "--admin-key-file",
        help=f"file holding the admin key (default: the key in ${ADMIN_KEY_ENV}, if set)",
    )
    actions = c.add_subparsers(dest="action", required=True)
    actions.add_parser("status", help="current and desired workers, SLA attainment")
    e = actions.add_parser("explain", help="the last decisions with reasons and figures")
    e.add_argument("-n", type=int, default=5, help="how many decisions")
    r = actions.add_parser("set-ratio", help="pin a prefill:decode ratio")
    r.add_argument(Role.PREFILL.value, type=int)
    r.add_argument(Role.DECODE.value, type=int)
    s = actions.add_parser("set-sla", help="change the SLA targets")
    s.add_argument("--ttft-p90", type=float, help="TTFT p90 target, ms")
    s.add_argument("--itl-p90", type=float, help="ITL p90 target, ms")
    actions.add_parser("auto", help="return to automatic control")
    t = actions.add_parser(
        "top", help="live view of the workers, request latency and the P:D ratio (q quits)"
    )
    t.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    t.add_argument("--once", action="store_true", help="print one frame and exit")
    c.set_defaults(func=run)
