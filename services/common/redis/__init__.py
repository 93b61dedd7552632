"""Everything Tandem keeps in Redis: the prefix index (`index`), worker discovery
(`registry`), the router's request log for the controller (`request_log`), and a local
Redis server for `tandem up` and tests (`server`)."""
