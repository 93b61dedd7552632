"""Everything Tandem keeps in Redis: the prefix index (`index`, with its key layout and Lua
scripts in `scripts` and its lean lookup client in `resp`), worker discovery (`registry`, over
the `WorkerInfo` records of `worker_info`), the router's request log for the controller
(`request_log`), a local Redis server for `tandem up` and tests (`server`), and the credentials
in Redis URLs: redaction for logs, and "wrong password" errors told from outages (`url`)."""
