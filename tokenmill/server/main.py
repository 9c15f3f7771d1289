"""Run the server: start the engine process, then uvicorn; drain on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import sys

import uvicorn

from tokenmill.frontend.async_llm import AsyncLLM
from tokenmill.server.app import build_app
from tokenmill.server.config import ServerConfig

log = logging.getLogger("tokenmill.server")


async def serve(config: ServerConfig, announce: bool = True) -> None:
    llm = await AsyncLLM.start(config.engine)
    app = build_app(llm, config)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level="warning",
            timeout_graceful_shutdown=int(config.drain_timeout_s),
            lifespan="off",
        )
    )
    original_exit = server.handle_exit

    def handle_exit(sig: int, frame: object) -> None:
        # SIGTERM/SIGINT: readiness turns false and new requests get 503 while in-flight ones finish.
        app.state.tm.draining = True
        original_exit(sig, frame)

    server.handle_exit = handle_exit  # type: ignore[method-assign]
    if announce:
        base = f"http://{config.host}:{config.port}"
        print(
            f"tokenmill serving {config.model_name!r} on {base} "
            f"(max_model_len {llm.max_model_len}, engine loaded in {llm.client.info['load_seconds']:.2f}s)\n"
            f"  curl {base}/v1/chat/completions -H 'Content-Type: application/json' "
            f"""-d '{{"model": "{config.model_name}", "messages": """
            f"""[{{"role": "user", "content": "Hello!"}}]}}'\n"""
            f"  OpenAI client: OpenAI(base_url='{base}/v1', api_key='{config.api_key or 'none'}')",
            file=sys.stderr,
            flush=True,
        )
    try:
        await server.serve()
    finally:
        await llm.shutdown()


def run(config: ServerConfig) -> None:
    asyncio.run(serve(config))
