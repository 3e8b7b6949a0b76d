"""OpenAI- and Anthropic-compatible HTTP server (aiohttp): `create_app`, `run_server`, `ServerThread`."""

from ktlite.server.app import OpenAIServer, ServerOptions, ServerThread, create_app, run_server, warmup

__all__ = ["OpenAIServer", "ServerOptions", "ServerThread", "create_app", "run_server", "warmup"]
