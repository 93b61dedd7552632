"""The worker process shared by prefill and decode: the gRPC shell with heartbeat and drain
(`shell`), the engine thread bridged to asyncio (`engine_loop`), and the publisher of the
engine's KV events to the prefix index (`kv_events`)."""
