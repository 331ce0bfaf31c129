"""Turns a capture_server.py log into a test fixture: one request of each kind a client sent.

    python benchmarks/clients/extract_fixtures.py LOG OUT.json --client="lm-eval 0.4.13" \
        --command="benchmarks/clients/lm_eval.sh ..."

A kind is the method, the path and the body's sorted keys (with `stream` and `max_tokens`, so
that a loglikelihood request, echo with max_tokens 1, and a generation are two kinds). The
first request of each kind is kept whole; Host and Content-Length are dropped from its headers
(they vary with the port and the body). OUT.json also counts every kind's requests.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

VARYING_HEADERS = {"host", "content-length"}


def kind(entry: dict) -> str:
    body = entry["body"]
    keys = ",".join(sorted(body)) if isinstance(body, dict) else type(body).__name__
    extra = {k: body[k] for k in ("stream", "max_tokens") if isinstance(body, dict) and k in body}
    return f"{entry['method']} {entry['path']} [{keys}] {json.dumps(extra, sort_keys=True)}"


def fixture(entries: list[dict], client: str, command: str) -> dict:
    """{client, command, counts: {kind: n}, requests: [first request of each kind]}."""
    counts: dict[str, int] = {}
    requests = []
    for entry in entries:
        k = kind(entry)
        if k not in counts:
            headers = {
                h: v for h, v in entry["headers"].items() if h.lower() not in VARYING_HEADERS
            }
            requests.append(
                dict(
                    method=entry["method"], path=entry["path"], headers=headers, body=entry["body"]
                )
            )
        counts[k] = counts.get(k, 0) + 1
    return dict(client=client, command=command, counts=counts, requests=requests)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--client", required=True)
    parser.add_argument("--command", required=True)
    args = parser.parse_args()
    entries = [json.loads(line) for line in args.log.read_text().splitlines() if line.strip()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = fixture(entries, args.client, args.command)
    args.out.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    print(f"{args.out}: {len(result['requests'])} kinds of {len(entries)} requests")


if __name__ == "__main__":
    main()
