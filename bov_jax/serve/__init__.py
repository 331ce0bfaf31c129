"""The OpenAI-compatible HTTP server over the serving engine (`python -m bov_jax.serve`).

A request's path, top down:

    __main__     the command: flags, loading a run, the engine, start-up checks and log
    running      the uvicorn server on a bound socket, signals, graceful drain
    app          the FastAPI application: the routes, wired to the modules below
    errors       OpenAI's error shape for every failure (400, 404, 405, 413, 415, 500)
    protocol     request and response models (pydantic), as vLLM's entrypoints/openai/protocol
    completions  /v1/completions: prompts, echo, n, streaming, logprobs
    chat         /v1/chat/completions: nanochat's conversation format over the same engine
    tokens       /tokenize, /detokenize, /tokenizer_info
    metrics      Prometheus metrics (prometheus-client): latency histograms, counters, gauges
    engine_loop  the engine stepping on its own thread, outputs routed to each request's queue

The engine itself (bov_jax/inference/) knows nothing of HTTP.
"""
