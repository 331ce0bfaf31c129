"""Serving the application: a bound socket, uvicorn, the engine thread; in this process on a
background thread (`running_server`: tests, the serving benchmark) or until a signal (`serve`).

`serve` takes a socket bound before the model loads (a busy port is found at once). The
first SIGINT or SIGTERM starts a bounded drain: new API requests get 503 and /health says
"draining", the requests in flight may finish for up to drain_s seconds, and those still
running then end with an error (a stream: an error event, then [DONE]); then the server
exits 0. A second signal ends the requests in flight at once, the same way. uvicorn's own
signal handling (which waits for every stream without a limit and re-raises the signal
after, a KeyboardInterrupt's traceback) is replaced.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType

import uvicorn
from fastapi import FastAPI

from bov_jax.inference.engine import Engine
from bov_jax.inference.texts import Tokenizer
from bov_jax.serve import errors
from bov_jax.serve.app import create_app
from bov_jax.serve.engine_loop import EngineLoop
from bov_jax.serve.warmup import compile_steps

log = logging.getLogger("bov_jax.serve")
SIGNALS = (signal.SIGINT, signal.SIGTERM)
CLOSE_S = 5.0  # after the drain, how long uvicorn waits for responses to finish sending


def bound_socket(host: str, port: int, listen: bool = True) -> socket.socket:
    """A TCP socket bound to (host, port), listening unless `listen` is False (uvicorn
    listens when it starts serving: until then a client is refused, not left waiting);
    port 0 picks a free one. OSError if the address is in use."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    if listen:
        sock.listen(128)
    return sock


def base_url(sock: socket.socket) -> str:
    name, port = sock.getsockname()[:2]
    return f"http://{'[' + name + ']' if ':' in name else name}:{port}"


def application(
    engine: Engine,
    tokenizer: Tokenizer,
    model_name: str,
    warmup: bool,
    max_body_bytes: int = errors.MAX_BODY_BYTES,
) -> tuple[EngineLoop, FastAPI]:
    """The engine loop (started; warming up first if `warmup`) and the app over it."""
    loop = EngineLoop(
        engine, (lambda stopping: compile_steps(engine, stopping)) if warmup else None
    )
    loop.start()
    app = create_app(loop, tokenizer, model_name)
    app.state.max_body_bytes = max_body_bytes
    return loop, app


class DrainingServer(uvicorn.Server):
    """uvicorn with the module doc's signal handling."""

    def __init__(self, config: uvicorn.Config, loop: EngineLoop, app: FastAPI, drain_s: float):
        super().__init__(config)
        self.engine_loop, self.app_state, self.drain_s = loop, app.state, drain_s
        self.signals = 0

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.signals += 1
        name = signal.Signals(sig).name
        if self.signals == 1:
            log.info(
                "%s: draining %d requests for at most %g s (--drain_s); new ones get 503; "
                "a second signal ends them now",
                name,
                self.engine_loop.in_flight,
                self.drain_s,
            )
            self.begin_drain()
        else:
            cut = self.engine_loop.cut(f"the server was stopped ({name} twice)")
            log.info("%s again: %d requests ended now", name, cut)

    def begin_drain(self) -> None:
        self.app_state.refusing = "the server is shutting down"
        threading.Thread(target=self.drain, name="drain", daemon=True).start()

    def drain(self) -> None:
        start = time.monotonic()
        reason = f"the server stopped: the request outlived the {self.drain_s:g} s drain"
        cut = self.engine_loop.drain(self.drain_s, reason)
        waited = time.monotonic() - start
        if cut:
            log.info("drained in %.1f s; %d requests ended with an error", waited, cut)
        else:
            log.info("drained in %.1f s", waited)
        self.should_exit = True


def uvicorn_config(app: FastAPI) -> uvicorn.Config:
    """uvicorn quiet (the project logs start-up and shutdown itself), no lifespan."""
    return uvicorn.Config(
        app,
        log_config=None,
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=int(CLOSE_S),
    )


@contextlib.contextmanager
def running_server(
    engine: Engine,
    tokenizer: Tokenizer,
    model_name: str,
    host: str = "127.0.0.1",
    port: int = 0,
    warmup: bool = False,
) -> Iterator[str]:
    """Serve in this process on a background thread; yields the base URL, and stops the
    server and the engine thread on exit (tests and the serving benchmark). With `warmup`
    the engine compiles its steps first (/health says 503 until it is done)."""
    loop, app = application(engine, tokenizer, model_name, warmup)
    sock = bound_socket(host, port)
    server = uvicorn.Server(uvicorn_config(app))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("the server thread ended before it started")
            time.sleep(0.01)
        yield base_url(sock)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
        loop.stop()


def serve(
    engine: Engine,
    tokenizer: Tokenizer,
    model_name: str,
    sock: socket.socket,
    *,
    drain_s: float,
    max_body_bytes: int,
    warmup: bool,
    on_ready: Callable[[], None] | None = None,
) -> None:
    """Serve on `sock` (bound, `bound_socket(listen=False)`) until a signal (module doc)."""
    loop, app = application(engine, tokenizer, model_name, warmup, max_body_bytes)
    try:
        server = DrainingServer(uvicorn_config(app), loop, app, drain_s)
        if on_ready is not None:
            threading.Thread(target=announce, args=(loop, server, on_ready), daemon=True).start()
        server.run(sockets=[sock])
    finally:
        loop.stop()
        sock.close()


def announce(loop: EngineLoop, server: uvicorn.Server, on_ready: Callable[[], None]) -> None:
    """Call on_ready once the engine is warm and uvicorn accepts connections."""
    loop.ready.wait()
    while not server.started and not server.should_exit:
        time.sleep(0.01)
    if server.started:
        on_ready()
