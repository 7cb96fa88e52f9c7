"""`chatserve chat`: a terminal chat client for a running chatserve (or any OpenAI-compatible) server.

Streams replies over SSE; /system, /clear, /help, /quit; Ctrl-C stops a reply (the server aborts it).
Not a server component: it only speaks HTTP.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable, Generator

import httpx

from chatserve.bench.sse_client import SSEParser

HELP = """commands:
  /system TEXT   set the system prompt (and start over)
  /clear         forget the conversation
  /help          this text
  /quit          leave (also Ctrl-D)
Ctrl-C while a reply streams stops it."""


class ChatError(Exception):
    pass


def stream_reply(client: httpx.Client, messages: list[dict], *, model: str | None, max_tokens: int | None,
                 temperature: float | None) -> Generator[str | dict, None, None]:
    """Yields text deltas, then the usage dict (if the server sends one). Raises ChatError."""
    body: dict = {"messages": messages, "stream": True, "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    if max_tokens:
        body["max_tokens"] = max_tokens
    if temperature is not None:
        body["temperature"] = temperature
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            try:
                msg = r.json()["error"]["message"]
            except Exception:
                msg = r.text[:300]
            raise ChatError(f"HTTP {r.status_code}: {msg}")
        parser = SSEParser()                    # the bench client's parser: multi-line data events too
        for raw in r.iter_bytes():
            for ev in parser.feed(raw):
                if ev.data == "[DONE]":
                    return
                obj = json.loads(ev.data)
                if "error" in obj:
                    raise ChatError(obj["error"].get("message", "error"))
                for ch in obj.get("choices") or []:
                    text = (ch.get("delta") or {}).get("content")
                    if text:
                        yield text
                if obj.get("usage"):
                    yield obj["usage"]


def format_usage(u: dict) -> str:
    ext = u.get("chatserve") or {}
    parts = [f"{u.get('completion_tokens', 0)} tokens"]
    if ext.get("ttft_s") is not None:
        parts.append(f"first token {ext['ttft_s']:.2f} s")
    if ext.get("tokens_per_s"):
        parts.append(f"{ext['tokens_per_s']:.1f} tok/s")
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
    parts.append(f"prompt {u.get('prompt_tokens', 0)} ({cached or 0} cached)")
    return "[" + " · ".join(parts) + "]"


def run(args: argparse.Namespace, read: Callable[[str], str] = input,
        write: Callable[[str], object] = sys.stdout.write) -> int:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    system = args.system
    history: list[dict] = []
    color = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    dim = (lambda s: f"\x1b[2m{s}\x1b[0m") if color else (lambda s: s)
    with httpx.Client(base_url=args.url.rstrip("/"), headers=headers, timeout=httpx.Timeout(600, connect=10)) as client:
        try:
            info = client.get("/v1/models").json()["data"][0]["id"]
            write(dim(f"connected to {args.url} · model {info} · /help for commands") + "\n")
        except Exception as e:
            write(f"cannot reach {args.url}: {e}\n")
            return 1
        while True:
            try:
                line = read("you> ")
            except (EOFError, KeyboardInterrupt):
                write("\n")
                return 0
            line = line.strip()
            if not line:
                continue
            if line in ("/quit", "/exit"):
                return 0
            if line == "/help":
                write(HELP + "\n")
                continue
            if line == "/clear":
                history.clear()
                write(dim("(conversation cleared)") + "\n")
                continue
            if line.startswith("/system"):
                system = line[len("/system"):].strip() or None
                history.clear()
                write(dim(f"(system prompt {'set' if system else 'removed'}; conversation cleared)") + "\n")
                continue
            if line.startswith("/"):
                write(f"unknown command {line.split()[0]}; /help lists them\n")
                continue
            history.append({"role": "user", "content": line})
            msgs = ([{"role": "system", "content": system}] if system else []) + history
            reply = _show_reply(client, args, msgs, write, dim)
            if reply is None:
                history.pop()
            else:
                history.append({"role": "assistant", "content": reply})


def _show_reply(client: httpx.Client, args: argparse.Namespace, msgs: list[dict],
                write: Callable[[str], object], dim: Callable[[str], str]) -> str | None:
    """Stream one reply to the terminal, then its usage line. Returns its text (partial when stopped
    with Ctrl-C), or None after an error."""
    reply, usage = "", None
    write("bot> ")
    gen = stream_reply(client, msgs, model=args.model, max_tokens=args.max_tokens,
                       temperature=args.temperature)
    try:
        for item in gen:
            if isinstance(item, str):
                reply += item
                write(item)
                if hasattr(sys.stdout, "flush"):
                    sys.stdout.flush()
            else:
                usage = item
    except KeyboardInterrupt:
        gen.close()                       # closes the connection: the server aborts the reply
        write(dim(" [stopped]"))
    except (ChatError, httpx.HTTPError) as e:
        write(f"\n(error: {e})\n")
        return None
    write("\n")
    if usage:
        write(dim(format_usage(usage)) + "\n")
    return reply


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="chatserve chat", description="Chat with a chatserve server.")
    p.add_argument("--url", default=os.environ.get("CHATSERVE_URL", "http://127.0.0.1:8000"))
    p.add_argument("--api-key", default=os.environ.get("CHATSERVE_API_KEY"))
    p.add_argument("--model", default=None)
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None)
    args = p.parse_args(argv)
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    return run(args)
