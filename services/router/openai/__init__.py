"""The router's OpenAI-compatible HTTP API: the FastAPI app (`http`), request parsing
(`protocol`, `choices`, `structured`, `tools`), the answers (`answers`), the Responses API
(`responses`, `responses_http`, `responses_tools`), server-sent events (`sse`) and the
fan-out of n > 1 choices (`fanout`)."""
