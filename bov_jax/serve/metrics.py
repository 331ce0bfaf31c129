"""Prometheus text exposition of the engine's statistics."""

from __future__ import annotations


def prometheus(stats: dict[str, float], prefix: str = "bov") -> str:
    """Stats as Prometheus text exposition (gauges, and counters for the *_total names)."""
    meaning = {
        "running": ("requests_running", "gauge", "Requests prefilling or decoding."),
        "waiting": ("requests_waiting", "gauge", "Requests queued for pages or a slot."),
        "pages_used": ("pages_used", "gauge", "Cache pages held by requests (all groups)."),
        "pages_free": ("pages_free", "gauge", "Cache pages free (all groups)."),
        "tokens_per_second": ("tokens_per_second", "gauge", "Generated tokens a second."),
        "generated_tokens": ("generated_tokens_total", "counter", "Tokens generated."),
        "preemptions": ("preemptions_total", "counter", "Sequences preempted for pages."),
        "aborted": ("requests_aborted_total", "counter", "Requests aborted (client gone)."),
        "steps": ("engine_steps_total", "counter", "Engine steps run."),
    }
    lines = []
    for key, (name, kind, help_text) in meaning.items():
        lines += [
            f"# HELP {prefix}_{name} {help_text}",
            f"# TYPE {prefix}_{name} {kind}",
            f"{prefix}_{name} {stats[key]:g}",
        ]
    return "\n".join(lines) + "\n"
