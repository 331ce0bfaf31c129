"""Serving the application: a bound socket, uvicorn, the engine thread; in this process on a
background thread (`running_server`: tests, the serving benchmark) or until a signal (`serve`)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import uvicorn

from bov_jax.inference.engine import Engine
from bov_jax.inference.texts import Tokenizer
from bov_jax.serve.app import create_app
from bov_jax.serve.engine_loop import EngineLoop


def bound_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); port 0 picks a free one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    return sock


@contextlib.contextmanager
def running_server(
    engine: Engine,
    tokenizer: Tokenizer,
    model_name: str,
    host: str = "127.0.0.1",
    port: int = 0,
) -> Iterator[str]:
    """Serve in this process on a background thread; yields the base URL, and stops the
    server and the engine thread on exit (tests and the serving benchmark)."""
    loop = EngineLoop(engine)
    loop.start()
    app = create_app(loop, tokenizer, model_name)
    sock = bound_socket(host, port)
    config = uvicorn.Config(app, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("the server thread ended before it started")
            time.sleep(0.01)
        name, bound = sock.getsockname()[:2]
        yield f"http://{'[' + name + ']' if ':' in name else name}:{bound}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
        loop.stop()


def serve(engine: Engine, tokenizer: Tokenizer, model_name: str, host: str, port: int) -> None:
    """Serve until interrupted (`python -m bov_jax.serve`)."""
    loop = EngineLoop(engine)
    loop.start()
    try:
        app = create_app(loop, tokenizer, model_name)
        uvicorn.run(app, host=host, port=port, log_level="info", lifespan="off")
    finally:
        loop.stop()
