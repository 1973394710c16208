"""A streamed completion read with plain httpx: Server-Sent Events, line by line.

    python clients/examples/httpx_sse.py [--base-url http://127.0.0.1:8000/v1]
        [--model micro] [--speculation prompt_lookup | '{"method": "early_exit", ...}']
        [--prompt TEXT] [--max-tokens 32] [--api-key KEY]

Each event is a ``data: {json}`` line followed by a blank line; the stream ends with
``data: [DONE]``. A chunk's ``choices[0].text`` is the new text; nodraft adds a
``nodraft`` field saying where each token came from -- an **accepted** draft token or the
target's own **bonus** token, one per target pass -- and the draft tokens verification
rejected. The final chunk carries ``usage`` (asked for with ``include_usage``) and the
request's ``speculation`` figures.

Tokens print as they arrive; accepted draft tokens are underlined on a terminal.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import httpx

PROMPT = ("def area(width, height):\n    return width * height\n\n\n"
          "def area(width, height):\n")


def events(response: httpx.Response):
    """The JSON payloads of an SSE stream, up to ``[DONE]``; the stream is read to its end
    (a response left unread closes its connection instead of returning it to the pool)."""
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue  # blank separators and ": ping" comments
        data = line[len("data: "):]
        if data != "[DONE]":
            yield json.loads(data)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", default="micro")
    p.add_argument("--speculation", default="prompt_lookup",
                   help="a method name or a JSON object")
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "nodraft"))
    args = p.parse_args()
    spec_field = (json.loads(args.speculation) if args.speculation.lstrip().startswith("{")
                  else args.speculation)
    body = {"model": args.model, "prompt": args.prompt, "max_tokens": args.max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "speculation": spec_field}
    underline = sys.stdout.isatty()
    headers = {"Authorization": f"Bearer {args.api_key}"}
    origins = {"accepted": 0, "bonus": 0}
    final = None
    print(args.prompt, end="")
    with httpx.stream("POST", args.base_url.rstrip("/") + "/completions", json=body,
                      headers=headers, timeout=60) as response:
        if response.status_code != 200:
            response.read()
            sys.exit(f"HTTP {response.status_code}: {response.text}")
        for chunk in events(response):
            if "error" in chunk:
                sys.exit(f"stream error: {chunk['error']['message']}")
            for token in (chunk.get("nodraft") or {}).get("tokens", []):
                origins[token["origin"]] += 1
                text = token["text"]
                if underline and token["origin"] == "accepted":
                    text = f"\x1b[4m{text}\x1b[0m"
                print(text, end="", flush=True)
            if "speculation" in chunk:
                final = chunk
    spec = final["speculation"]
    print(f"\n\n{final['usage']['completion_tokens']} tokens: {origins['accepted']} accepted "
          f"draft tokens, {origins['bonus']} bonus tokens")
    print(json.dumps(spec, indent=1))


if __name__ == "__main__":
    main()
