"""Chat completions with the official ``openai`` client, choosing a drafter per request.

    python clients/examples/openai_chat.py [--base-url http://127.0.0.1:8000/v1]
                                           [--model micro] [--api-key KEY]

The drafter goes in ``extra_body={"speculation": ...}``; the figures come back in the
response's ``speculation`` object -- ``response.to_dict()["speculation"]`` here, or
``response.model_extra["speculation"]`` -- and, when streaming, in the final chunk.
micro is a small model of Python source, not an assistant: its replies continue code.
"""

from __future__ import annotations

import argparse
import os

from openai import OpenAI

MESSAGES = [
    {"role": "system", "content": "You complete Python code."},
    {"role": "user", "content": "def is_even(n):\n    return n % 2 == 0\n\n\ndef is_odd(n):\n"},
]


def show(spec: dict) -> None:
    rate = ("nothing drafted" if spec["drafted"] == 0
            else f"acceptance rate {spec['acceptance_rate']:.0%} "
                 f"({spec['accepted']}/{spec['drafted']} draft tokens)")
    print(f"[{spec['method']}] {rate}, {spec['tokens_per_pass']:.2f} tokens per target pass, "
          f"draft cost {spec['draft_cost']:.2f} passes, "
          f"estimated speed-up {spec['estimated_speedup']:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", default="micro")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "nodraft"),
                   help="only checked if the server runs with --api-key")
    args = p.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)

    # 1. Not streamed, with suffix decoding.
    response = client.chat.completions.create(
        model=args.model, messages=MESSAGES, max_tokens=24, temperature=0,
        extra_body={"speculation": "suffix"})
    print(response.choices[0].message.content)
    show(response.to_dict()["speculation"])

    # 2. Streamed, with prompt lookup and its parameters.
    stream = client.chat.completions.create(
        model=args.model, messages=MESSAGES, max_tokens=24, temperature=0, stream=True,
        extra_body={"speculation": {"method": "prompt_lookup", "num_speculative_tokens": 4}})
    spec = None
    for chunk in stream:
        for choice in chunk.choices:
            print(choice.delta.content or "", end="", flush=True)
        if chunk.model_extra.get("speculation"):  # the final chunk
            spec = chunk.model_extra["speculation"]
    print()
    show(spec)


if __name__ == "__main__":
    main()
