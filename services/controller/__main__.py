"""`python -m tandem.services.controller --redis-url URL --actuator kubernetes ...`
(flags = ControllerConfig)."""

from __future__ import annotations

import asyncio
import sys

from tandem.services.common.runtime.flags import parse_config
from tandem.services.common.runtime.process import run_until_signal, setup_logging
from tandem.services.controller.actuators import Actuator, KubernetesActuator, NoActuator
from tandem.services.controller.config import ControllerConfig
from tandem.services.controller.server import Controller
from tandem.types import Role


def make_actuator(config: ControllerConfig) -> Actuator:
    if config.actuator == "kubernetes":
        return KubernetesActuator(
            config.namespace,
            {Role.PREFILL: config.prefill_deployment, Role.DECODE: config.decode_deployment},
            config.kubeconfig,
        )
    if config.actuator == "local":
        sys.exit("--actuator local runs inside `tandem up --autoscale`, not on its own")
    return NoActuator()


def main() -> None:
    config = parse_config(ControllerConfig, prog="python -m tandem.services.controller")
    setup_logging("controller")

    async def run() -> None:
        controller = Controller(config, make_actuator(config))
        await run_until_signal(
            controller.start, controller.stop, lambda: f"READY controller {controller.address}"
        )

    asyncio.run(run())


if __name__ == "__main__":
    main()
