"""`pdserve generate`: stream one completion from a router to the terminal.

The text goes to stdout as it arrives; the summary (finish reason, TTFT, tokens/s) goes to
stderr, so `pdserve generate ... > out.txt` keeps only the text.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from typing import TextIO

from pdserve.client import Client, Completion, PdserveError
from pdserve.commands import EXIT_INTERRUPTED, EXIT_USAGE, add_router_argument, fail, router_address
from pdserve.commands.connection import (
    ConnectionFlagError,
    add_connection_arguments,
    connection_from_args,
)
from pdserve.core.sampling_params import SamplingParams

# flags that map one-to-one onto SamplingParams fields; unset ones keep the engine's default
SAMPLING_FLAGS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")


def add_parser(subcommands: argparse._SubParsersAction) -> None:
    defaults = SamplingParams()
    cmd = subcommands.add_parser("generate", help="stream a completion from a router")
    cmd.add_argument("prompt", help="prompt text")
    add_router_argument(cmd)
    cmd.add_argument("--max-tokens", type=int, help=f"default {defaults.max_tokens}")
    cmd.add_argument(
        "--temperature", type=float, help=f"0 is greedy (default {defaults.temperature})"
    )
    cmd.add_argument("--top-p", type=float, help=f"default {defaults.top_p}")
    cmd.add_argument("--top-k", type=int, help="0 is off (the default)")
    cmd.add_argument("--seed", type=int, help="makes sampling with temperature > 0 repeatable")
    cmd.add_argument(
        "--stop",
        action="extend",
        nargs="+",
        metavar="S",
        help="stop strings (not part of the output)",
    )
    cmd.add_argument("--ignore-eos", action="store_true", help="run to --max-tokens")
    cmd.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object at the end instead of streaming text",
    )
    add_connection_arguments(cmd)
    cmd.set_defaults(run=run)


@dataclass(slots=True)
class ClientTimings:
    """What the client saw, beside the router's own timings."""

    ttft_ms: float | None  # call start until the first token arrived
    tokens_per_s: float | None  # tokens after the first, over the time since the first


def run(args: argparse.Namespace) -> int:
    echo = None if args.json else Echo(sys.stdout)
    try:
        connection = connection_from_args(args)
    except ConnectionFlagError as error:
        return fail("generate", error, EXIT_USAGE)
    try:
        with Client(router_address(args.router), **connection.client_kwargs) as client:
            completion, timings = stream(client, args.prompt, sampling_params(args), echo)
    except PdserveError as error:
        _end_line(echo)
        return fail("generate", error)
    except KeyboardInterrupt:  # leaving the stream cancels the request
        _end_line(echo)
        return EXIT_INTERRUPTED
    if args.json:
        print(json.dumps(_json(completion, timings)))
    else:
        _end_line(echo)
        print(_summary(completion, timings), file=sys.stderr)
    return 0


class Echo:
    """Writes streamed text through as it comes, and knows whether it left a line open."""

    def __init__(self, out: TextIO):
        self.out = out
        self.line_open = False

    def write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()
        self.line_open = not text.endswith("\n")

    def end_line(self) -> None:
        if self.line_open:
            self.write("\n")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    given = {name: getattr(args, name) for name in SAMPLING_FLAGS}
    return SamplingParams(
        **{name: value for name, value in given.items() if value is not None},
        ignore_eos=args.ignore_eos,
    )


def stream(
    client: Client, prompt: str, params: SamplingParams, echo: Echo | None
) -> tuple[Completion, ClientTimings]:
    """Stream a completion, writing each chunk's text to `echo` (if any) as it arrives."""
    chunks = []
    started = time.perf_counter()
    first_at = last_at = None
    for chunk in client.stream(prompt, params):
        now = time.perf_counter()
        if chunk.token_ids:
            first_at = now if first_at is None else first_at
            last_at = now
        if echo is not None and chunk.text:
            echo.write(chunk.text)
        chunks.append(chunk)
    completion = Completion.from_chunks(chunks)
    first_tokens = next((len(c.token_ids) for c in chunks if c.token_ids), 0)
    later_tokens = len(completion.token_ids) - first_tokens
    rate = None
    if first_at is not None and last_at > first_at and later_tokens > 0:
        rate = later_tokens / (last_at - first_at)
    ttft_ms = None if first_at is None else (first_at - started) * 1000
    return completion, ClientTimings(ttft_ms, rate)


def _end_line(echo: Echo | None) -> None:
    """Finish a partly streamed line, so what follows (prompt, message) starts on its own."""
    if echo is not None:
        echo.end_line()


def _json(completion: Completion, timings: ClientTimings) -> dict:
    return {
        "request_id": completion.request_id,
        "text": completion.text,
        "token_ids": completion.token_ids,
        "finish_reason": completion.finish_reason,
        "usage": dataclasses.asdict(completion.usage),
        "timings": completion.timings,
        "ttft_ms": timings.ttft_ms,
        "tokens_per_s": timings.tokens_per_s,
    }


def _summary(completion: Completion, timings: ClientTimings) -> str:
    usage = completion.usage
    router_ttft = (completion.timings or {}).get("ttft_ms")
    parts = [
        f"finish: {completion.finish_reason or 'none'}",
        f"tokens: {usage.prompt_tokens} prompt ({usage.cached_prompt_tokens} cached), "
        f"{usage.completion_tokens} generated",
        f"ttft: {_ms(timings.ttft_ms)} (router {_ms(router_ttft)})",
        f"{_rate(timings.tokens_per_s)} after the first token",
    ]
    return " | ".join(parts)


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f} ms"


def _rate(value: float | None) -> str:
    return "n/a tokens/s" if value is None else f"{value:.1f} tokens/s"
