"""Completions with the official ``openai`` client, choosing a drafter per request.

    python clients/examples/openai_completions.py [--base-url http://127.0.0.1:8000/v1]
                                                  [--model micro] [--api-key KEY]

nodraft extends the OpenAI API with one request field and one response object:

- ``speculation`` chooses the drafter. The client has no parameter for it, so it goes in
  ``extra_body``: ``{"speculation": "prompt_lookup"}`` or an object with parameters,
  ``{"speculation": {"method": "early_exit", "exit_layer": 2}}``.
- ``speculation`` in the response holds the request's figures (draft tokens, accepted
  tokens, target passes, ...). The client keeps unknown fields in ``model_extra``; when
  streaming they arrive in the final chunk.

The prompt repeats itself, so prompt lookup has something to copy.
"""

from __future__ import annotations

import argparse
import os

from openai import OpenAI

PROMPT = ("def area(width, height):\n    return width * height\n\n\n"
          "def area(width, height):\n")


def show(spec: dict) -> None:
    """One line of figures: draft tokens accepted, tokens per target pass, speed-up."""
    rate = ("nothing drafted" if spec["drafted"] == 0
            else f"{spec['accepted']} of {spec['drafted']} draft tokens accepted "
                 f"({spec['acceptance_rate']:.0%})")
    print(f"[{spec['method']}] {rate}, {spec['target_passes']} target passes, "
          f"{spec['tokens_per_pass']:.2f} tokens per target pass, "
          f"estimated speed-up {spec['estimated_speedup']:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", default="micro")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "nodraft"),
                   help="only checked if the server runs with --api-key")
    args = p.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)

    # 1. Not streamed: prompt lookup, by name.
    response = client.completions.create(
        model=args.model, prompt=PROMPT, max_tokens=24, temperature=0,
        extra_body={"speculation": "prompt_lookup"})
    print(PROMPT + response.choices[0].text)
    show(response.model_extra["speculation"])

    # 2. Streamed: early exit after layer 2, as an object with parameters.
    stream = client.completions.create(
        model=args.model, prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"speculation": {"method": "early_exit", "exit_layer": 2}})
    spec = None
    for chunk in stream:
        for choice in chunk.choices:
            print(choice.text, end="", flush=True)
        if chunk.usage is not None:  # the final chunk: usage and the figures
            print(f"\n{chunk.usage.completion_tokens} tokens generated")
            spec = chunk.model_extra["speculation"]
    show(spec)


if __name__ == "__main__":
    main()
