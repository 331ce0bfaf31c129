"""Request and response models of the OpenAI-compatible API (pydantic), apart from the routes."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from bov_jax.inference.sampling import SamplingParams


class CompletionRequest(BaseModel):
    """The fields of OpenAI's completions request this server takes (top_k and ignore_eos
    as vLLM's extensions); any other field is refused."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str
    prompt: str | list[int]
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    logprobs: int | None = None
    n: int = 1
    echo: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False
    user: str | None = None

    def sampling(self) -> SamplingParams:
        """The engine's parameters; ValueError naming a field this server cannot honour."""
        unsupported = [
            ("n", self.n != 1, "1 (one completion a request)"),
            ("echo", self.echo, "false"),
            ("presence_penalty", self.presence_penalty != 0, "0"),
            ("frequency_penalty", self.frequency_penalty != 0, "0"),
        ]
        for name, bad, expected in unsupported:
            if bad:
                raise ValueError(f"{name}={getattr(self, name)!r}; this server takes {expected}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            temperature=self.temperature,
            top_k=max(self.top_k, 0) if self.top_k != -1 else 0,
            top_p=self.top_p,
            seed=self.seed,
            max_tokens=self.max_tokens,
            stop=stop,
            logprobs=self.logprobs,
            ignore_eos=self.ignore_eos,
        )
