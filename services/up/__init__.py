"""`tandem up`: a whole cluster on one machine, as separate processes.

    redis  <-  prefill worker(s), decode worker(s)   (register + heartbeat)
    router ->  follows the registry, serves tandem.v1.Router on --port and the OpenAI
               HTTP API on --http-port
    controller (--autoscale, in this process) -> starts and stops workers, never more
               than the host holds (one per core, within the available memory: its
               capacity is logged at start and shown by `tandem ctl status`), serves
               tandem.v1.Admin on --admin-port for `tandem ctl`

Every child dies with this process (PR_SET_PDEATHSIG), and Ctrl-C stops them in order:
router first (no new requests), then workers (they drain), then Redis. Children run in their
own sessions, so a terminal's Ctrl-C reaches only this process, which decides the order.

Supervision: a thread polls the children every 0.2 s. One that exits on its own (not during
`stop()`, not a worker the controller told to drain) is started again under the same name
with the same arguments (the router on the same port, Redis on the same socket, so every
`--redis-url` stays valid), after a backoff from `tandem.services.common.runtime.supervision`; its
log is
appended to, not truncated. Once a child exits more than `max_restarts` times within
`restart_window_s`, the supervisor reports it, stops the cluster and sets `failure`, which
`tandem up` turns into exit status 1. A restarted Redis is empty: workers' heartbeats
re-register them and the router's registry watcher picks them up (see
`services/common/redis/registry.py`).

Secrets and addresses: Redis gets a random password (and a socket only this user may open),
and the run directory a random cluster secret (`cluster.secret`, mode 0600) that every
process is given with `--cluster-secret-file`. The password travels in the environment
(REDIS_PASSWORD to Redis, TANDEM_REDIS_URL to the services), never on a command line, which
any local user can read with `ps`. With `api_keys` the router wants an API key: one is
generated for tenant "default" (`api_key`, and the router's `api-keys` file, mode 0600).
The gRPC listeners are on `host` (127.0.0.1), UCX's own on loopback (`LOOPBACK_UCX_ENV`).

Metrics: every router and worker (and the controller, with autoscale) serves Prometheus
/metrics on `host` at a port picked here before it starts (`--metrics-port`), so a restarted
child serves where scrapers already look: `Cluster.metrics_addresses`.
"""

from tandem.services.up.cluster import Cluster
from tandem.services.up.config import UpConfig
from tandem.services.up.processes import Child, wait_for_router

__all__ = ["Child", "Cluster", "UpConfig", "wait_for_router"]
