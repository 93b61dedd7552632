"""Speculative decoding: proposers draft tokens from text the request has already seen; the
engine verifies a draft in one target forward (tandem.engine.runner, scheduler)."""
