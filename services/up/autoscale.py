"""`tandem up --autoscale`: the ratio controller in this process, with the local actuator
(tandem.services.controller.actuators.LocalActuator) starting and stopping the cluster's workers."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from pathlib import Path

from tandem.services.controller.actuators import ProcessPool
from tandem.services.up.config import UpConfig
from tandem.services.up.processes import free_port, say


@dataclass(slots=True)
class EmbeddedController:
    """The running controller: its addresses, and how to stop it."""

    address: str
    metrics_address: str
    loop: asyncio.AbstractEventLoop
    stopping: asyncio.Event
    thread: threading.Thread

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.stopping.set)
        self.thread.join(timeout=10)


def start_controller(
    cfg: UpConfig, pool: ProcessPool, redis_url: str, cluster_secret_file: Path
) -> EmbeddedController:
    """Start the controller on its own thread and event loop, scaling `pool` (the cluster);
    return once it serves. Raises RuntimeError when it does not start."""
    from tandem.control.capacity import describe
    from tandem.services.common.runtime.flags import parse_config
    from tandem.services.controller.actuators import LocalActuator
    from tandem.services.controller.config import ControllerConfig
    from tandem.services.controller.host import HostMeter
    from tandem.services.controller.server import Controller

    metrics_port = free_port(cfg.host)
    config = parse_config(
        ControllerConfig,
        [
            *cfg.controller_args,
            # In this process: this argv is no command line anyone can read.
            "--redis-url", redis_url,
            "--cluster-secret-file", str(cluster_secret_file),
            "--actuator", "local",
            "--host", cfg.host,
            "--port", str(cfg.admin_port),
            "--metrics-port", str(metrics_port),
        ],
        prog="tandem up --controller-args",
    )  # fmt: skip
    ready = threading.Event()
    failure: list[BaseException] = []
    started: list[tuple[str, asyncio.AbstractEventLoop, asyncio.Event]] = []
    # The starting workers are up (READY): their peak memory is what the next one needs.
    actuator = LocalActuator(pool, HostMeter(cores=cfg.host_cores or None))
    say(f"autoscale: {describe(actuator.measure())}")

    async def serve() -> None:
        stop = asyncio.Event()
        controller = Controller(config, actuator)
        try:
            await controller.start()
        except BaseException as exc:
            failure.append(exc)
            ready.set()
            return
        started.append((controller.address, asyncio.get_running_loop(), stop))
        ready.set()
        await stop.wait()
        await controller.stop()

    thread = threading.Thread(target=asyncio.run, args=(serve(),), name="controller", daemon=True)
    thread.start()
    ready.wait()
    if failure:
        raise RuntimeError(f"controller did not start: {failure[0]}")
    address, loop, stop = started[0]
    return EmbeddedController(address, f"{cfg.host}:{metrics_port}", loop, stop, thread)
