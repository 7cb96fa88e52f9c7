"""The turn service: runs one reply per session in the background, independent of any connection.

A turn stores the user's message and a placeholder reply, generates from the stored history through
chat_service.stream_chat (keep_warm=True), saves the partial reply about once a second, and stores the
finished one with its usage. Any number of followers (the request that started it, and clients that
re-attach after a reload) receive its chunks, progress events and end. Not HTTP (routes.py).
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import secrets
import time
from collections.abc import AsyncGenerator as AsyncGeneratorABC
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncGenerator, AsyncIterator, Awaitable, Coroutine, Protocol

from chatserve.server.errors import APIError, invalid
from chatserve.server.sessions.inputs import TurnRequest
from chatserve.server.sessions.session import ROOT, Session, chat_messages, history_message
from chatserve.server.sessions.store import SessionStore, StoreUnavailable, valid_session_id

if TYPE_CHECKING:
    from chatserve.server.protocol import ChatRequest
    from chatserve.server.state import ServerState

log = logging.getLogger("chatserve.sessions")

TICK_S = 0.2              # progress polling period
SAVE_EVERY_S = 1.0        # partial reply / heartbeat save period
HEARTBEAT_S = 5.0         # a turn with nothing new still refreshes its heartbeat this often
_END = object()


class ChatBackend(Protocol):
    """What makes a turn's reply: chat_service by default (ChatServiceBackend); tests give a scripted one to
    `install(app, state, backend=...)`. `parse` validates and tokenizes a chat body (it may be a coroutine
    function); `stream` yields its chunk dicts."""

    def parse(self, body: dict[str, Any], state: ServerState,
              rate_key: str | None = None) -> ChatRequest | Awaitable[ChatRequest]: ...
    def stream(self, state: ServerState, req: ChatRequest, *, owner: str, keep_warm: bool, request_id: str | None,
               rate_key: str | None = None) -> AsyncIterator[dict[str, Any]]: ...
    def rewarm(self, state: ServerState, messages: list[dict[str, Any]], *, owner: str,
               request_id: str, model: str | None = None) -> Coroutine[Any, Any, int]: ...


class ChatServiceBackend:
    """Adapter over chatserve.server.chat_service (imported on first use). Bodies go through the
    server's prompt guard: size bound, rate limits, then tokenizing where it cannot stall the loop."""

    async def parse(self, body: dict[str, Any], state: ServerState, rate_key: str | None = None) -> ChatRequest:
        from chatserve.server import admission, chat_service
        return await admission.admit(state, body, chat_service.parse_chat_body,
                                        rate_key=rate_key or "anonymous")   # set by start()

    def stream(self, state: ServerState, req: ChatRequest, *, owner: str, keep_warm: bool, request_id: str | None,
               rate_key: str | None = None) -> AsyncIterator[dict[str, Any]]:
        from chatserve.server import chat_service
        return chat_service.stream_chat(state, req, owner=owner, keep_warm=keep_warm,
                                        request_id=request_id, rate_key=rate_key)

    def rewarm(self, state: ServerState, messages: list[dict[str, Any]], *, owner: str,
               request_id: str, model: str | None = None) -> Coroutine[Any, Any, int]:
        from chatserve.server.sessions import rewarm
        return rewarm.rewarm(state, messages, owner=owner, request_id=request_id, model=model)


def _release(req: Any) -> None:
    """Give back the model lease of a parsed request that will not run (a test's backend parses to a
    plain dict, which holds none)."""
    from chatserve.server.protocol import ChatRequest
    if isinstance(req, ChatRequest):
        req.release()


def not_found() -> APIError:
    return APIError(404, "session not found", code="session_not_found")


def busy() -> APIError:
    return APIError(409, "a reply is already being generated in this session", code="session_busy")


@dataclass
class LiveTurn:
    """One generation in one session, as this process runs it."""

    id: str
    session_id: str
    owner: str
    cache_owner: str                      # whose prefix cache the turn may use (identity.cache_owner_of)
    message_id: str                       # the assistant message being written
    parent_id: str
    user_message_id: str | None
    request_id: str                       # the engine's request id
    model: str = ""
    messages: list[dict[str, Any]] = field(default_factory=list)  # the chat the reply answers, as the template gets it
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)     # delta.reasoning_content, apart from the answer
    phase: str = "queued"
    progress: dict[str, Any] | None = None          # the last progress event sent
    followers: set[asyncio.Queue[Any]] = field(default_factory=set)
    task: asyncio.Task[None] | None = None
    admitted: asyncio.Future[None] | None = None   # set when the turn starts
    cancelled: bool = False
    running: bool = False                 # _run has begun (a task cancelled before that never runs)
    finishing: bool = False
    done: bool = False
    saving: asyncio.Future[Any] | None = None  # the partial save in flight (see TurnService._save_partial)

    def event(self, replay: bool) -> dict[str, Any]:
        return {"object": "chatserve.turn", "id": self.id, "session_id": self.session_id,
                "message_id": self.message_id, "parent_id": self.parent_id or None,
                "user_message_id": self.user_message_id, "replay": replay}

    def follow(self, replay: bool) -> asyncio.Queue[Any]:
        """A queue that receives this turn's items from now on (after a replay of the text so far)."""
        q: asyncio.Queue[Any] = asyncio.Queue()
        q.put_nowait(self.event(replay))
        if replay:
            delta = {"role": "assistant", "content": "".join(self.text)}
            if self.reasoning:
                delta["reasoning_content"] = "".join(self.reasoning)
            q.put_nowait({"id": self.request_id, "object": "chat.completion.chunk",
                          "created": int(time.time()), "model": self.model,
                          "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
            if self.progress is not None and not self.text and not self.reasoning:
                q.put_nowait(self.progress)
        if self.done:
            q.put_nowait(_END)
        else:
            self.followers.add(q)
        return q

    def publish(self, item: Any) -> None:
        for q in self.followers:
            q.put_nowait(item)

    def cancel(self) -> None:
        self.cancelled = True
        if self.task is not None and self.running and not self.finishing and not self.task.done():
            self.task.cancel()


@dataclass
class _Outcome:
    """What a turn's stream produced so far: how it ended, its usage, and its error if any."""

    finish: str | None = None
    usage: dict[str, Any] | None = None
    first_token_at: float | None = None
    reasoning_at: float | None = None     # the first reasoning text
    answer_at: float | None = None        # the first answer text after reasoning
    n_chunks: int = 0
    n_content: int = 0                    # chunks that carried text
    error: str | None = None
    early: BaseException | None = None    # an APIError before the first chunk: raised to the starter

    def take(self, turn: LiveTurn, item: dict[str, Any]) -> None:
        """Fold one chunk into the turn's text and this outcome."""
        self.n_chunks += 1
        for ch in item.get("choices") or []:
            delta = ch.get("delta") or {}
            for key, parts in (("reasoning_content", turn.reasoning), ("content", turn.text)):
                if not delta.get(key):
                    continue
                parts.append(delta[key])
                self.n_content += 1
                now = time.perf_counter()
                if self.first_token_at is None:
                    self.first_token_at = now
                    turn.phase = "generating"
                if key == "reasoning_content" and self.reasoning_at is None:
                    self.reasoning_at = now
                if key == "content" and self.reasoning_at is not None and self.answer_at is None:
                    self.answer_at = now
            if ch.get("finish_reason"):
                self.finish = ch["finish_reason"]
        if item.get("usage"):
            self.usage = item["usage"]
        if item.get("error"):
            self.error = str((item["error"] or {}).get("message") or "generation failed")
            self.finish = "error"

    def reply(self, turn: LiveTurn, t0: float) -> dict[str, Any] | None:
        """The reply message to store, or None to drop the placeholder (refused, or nothing said
        before an error)."""
        text, reasoning = "".join(turn.text), "".join(turn.reasoning)
        if self.early is not None or (not text and not reasoning and self.error):
            return None
        msg: dict[str, Any] = {"content": text, "finish_reason": self.finish or "stop",
                               "usage": usage_record(self.usage, t0, self.first_token_at, self.n_content)}
        if reasoning:
            msg["reasoning_content"] = reasoning
            end = self.answer_at or time.perf_counter()
            msg["usage"]["reasoning_s"] = round(end - (self.reasoning_at or end), 3)
        if self.error:
            msg["error"] = self.error[:500]
        return msg


async def _follow_stream(turn: LiveTurn, agen: AsyncIterator[dict[str, Any]], out: _Outcome) -> None:
    """Publish the stream's chunks to the turn's followers until it ends, fails or is cancelled."""
    admitted = turn.admitted
    assert admitted is not None                   # start() sets it before the turn runs
    try:
        async for item in agen:
            if not admitted.done():
                admitted.set_result(None)
            out.take(turn, item)
            turn.publish(item)
            if turn.cancelled:               # stopped before this task was running
                break
    except asyncio.CancelledError:
        turn.cancelled = True
    except Exception as e:
        if out.n_chunks == 0 and isinstance(e, APIError):
            out.early = e
        else:
            out.error = getattr(e, "message", None) or str(e) or type(e).__name__
            log.warning("session %s: generation failed: %s", turn.session_id, out.error)
            out.finish = "error"
            turn.publish({"error": {"message": out.error, "type": "server_error", "param": None,
                                    "code": "generation_failed"}})


async def drain(turn: LiveTurn, q: asyncio.Queue[Any]) -> AsyncGenerator[dict[str, Any], None]:
    """Follow a turn: its items until it ends. Leaving early only stops following."""
    try:
        while True:
            item = await q.get()
            if item is _END:
                return
            yield item
    finally:
        turn.followers.discard(q)


class TurnService:
    """Starts, follows, cancels and finishes the turns of this process (at most one per session)."""

    def __init__(self, app_state: Any, state: ServerState, store: SessionStore,
                 backend: ChatBackend | None = None) -> None:
        self.app_state, self.state, self.store = app_state, state, store
        self.by_session: dict[str, LiveTurn] = {}
        self.rewarming: set[asyncio.Task[int]] = set()
        self.backend: ChatBackend = backend or ChatServiceBackend()

    def live(self, owner: str, sid: str) -> LiveTurn | None:
        t = self.by_session.get(sid)
        return t if t is not None and t.owner == owner else None

    # ── starting ──────────────────────────────────────────────────────────────────────────────
    async def start(self, owner: str, sid: str, treq: TurnRequest, rate_key: str | None = None,
                    cache_owner: str | None = None) -> AsyncGenerator[dict[str, Any], None]:
        """Store the user's message and the placeholder, start generating, and return the starter's
        stream. An APIError before the first chunk (validation, overload, rate limit, context too
        long) is raised here, and the placeholder is removed (the user's message stays)."""
        if not valid_session_id(sid):
            raise not_found()
        if sid in self.by_session:
            raise busy()
        rate_key = rate_key or owner
        user_id = None if treq.content is None else "m_" + secrets.token_urlsafe(9)
        reply_id = "m_" + secrets.token_urlsafe(9)
        turn = LiveTurn(id="turn_" + secrets.token_urlsafe(9), session_id=sid, owner=owner,
                        cache_owner=cache_owner or owner, message_id=reply_id, parent_id="", user_message_id=user_id,
                        request_id=f"sess-{sid[:8]}-{secrets.token_hex(4)}")
        self.by_session[sid] = turn                          # claimed before any await
        req: ChatRequest | None = None
        try:
            history: list[list[dict[str, Any]]] = []

            def add_turn(s: Session) -> None:
                history[:] = [_add_turn(s, treq, turn, user_id, reply_id)]

            cur = await self.store.get(owner, sid)           # validate on a preview first, so a
            if cur is None:                                   # rejected request changes nothing
                raise not_found()
            if cur.turn_live():
                raise busy()                                  # another replica is generating here
            add_turn(cur)
            preview = history[0]
            req = await self._parse(cur, preview, treq.overrides, rate_key)
            s = await self.store.update(owner, sid, add_turn)
            if s is None:
                raise not_found()
            if _chat_key(s, history[0]) != _chat_key(cur, preview):
                _release(req)
                req = await self._parse(s, history[0], treq.overrides, None)   # changed meanwhile
            turn.messages = chat_messages(s, history[0])
            turn.model = s.model or self.state.model_name or ""
        except BaseException:
            self.by_session.pop(sid, None)
            _release(req)                                     # its model's lease (admission.admit)
            raise
        q = turn.follow(replay=False)
        turn.admitted = asyncio.get_running_loop().create_future()
        turn.task = asyncio.get_running_loop().create_task(self._run(turn, req, rate_key))
        turn.task.add_done_callback(lambda _t: _release(req))   # even a turn cancelled before it ran
        try:
            await asyncio.shield(turn.admitted)
        except asyncio.CancelledError:
            turn.followers.discard(q)                         # the caller left; the turn goes on
            raise
        return drain(turn, q)

    async def _parse(self, s: Session, history: list[dict[str, Any]], overrides: dict[str, Any],
                     rate_key: str | None) -> ChatRequest:
        chat: dict[str, Any] = {
            "model": s.model or self.state.model_name or "default",
            "messages": chat_messages(s, history),
            "stream": True, "stream_options": {"include_usage": True},
            **s.params, **overrides}
        req = self.backend.parse(chat, self.state, rate_key)
        return await req if inspect.isawaitable(req) else req

    # ── following and stopping ────────────────────────────────────────────────────────────────
    def attach(self, owner: str, sid: str) -> AsyncGenerator[dict[str, Any], None]:
        """The running turn's stream from now on, after its text so far (one replay chunk)."""
        turn = self.live(owner, sid) if valid_session_id(sid) else None
        if turn is None or turn.done:
            raise APIError(404, "no reply is being generated in this session", code="no_active_turn")
        return drain(turn, turn.follow(replay=True))

    def cancel(self, owner: str, sid: str) -> bool:
        turn = self.live(owner, sid)
        if turn is None:
            return False
        turn.cancel()
        return True

    async def shutdown(self, grace_s: float) -> None:
        """Let running turns finish for up to grace_s, stop the rest, wait for their replies to be
        saved, then flush and close the store."""
        deadline = time.monotonic() + grace_s
        while self.by_session and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for task in list(self.rewarming):
            task.cancel()
        tasks = [t.task for t in self.by_session.values() if t.task is not None]
        for t in list(self.by_session.values()):
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        await self.store.aclose()

    # ── running ───────────────────────────────────────────────────────────────────────────────
    async def _run(self, turn: LiveTurn, req: ChatRequest, rate_key: str | None) -> None:
        turn.running = True
        t0 = time.perf_counter()
        out = _Outcome()
        ticker = asyncio.get_running_loop().create_task(self._tick(turn))
        agen = self.backend.stream(self.state, req, owner=turn.cache_owner, keep_warm=True,
                                   request_id=turn.request_id, rate_key=rate_key)
        try:
            await _follow_stream(turn, agen, out)
        finally:
            turn.finishing = True
            ticker.cancel()
            await asyncio.gather(ticker, return_exceptions=True)
            if turn.saving is not None:              # a partial save is never cut off mid-write
                await asyncio.gather(turn.saving, return_exceptions=True)
            if isinstance(agen, AsyncGeneratorABC):
                try:
                    await agen.aclose()              # aborts the engine request if still running
                except Exception:
                    pass
        if turn.cancelled and out.early is None:
            out.finish = "abort"
            turn.publish({"id": turn.request_id, "object": "chat.completion.chunk",
                          "created": int(time.time()), "model": turn.model,
                          "choices": [{"index": 0, "delta": {}, "finish_reason": "abort"}]})
        reply = out.reply(turn, t0)
        await self._finish(turn, reply)
        if reply is not None and reply.get("reasoning_content") and reply["finish_reason"] in ("stop", "length"):
            self._rewarm(turn, reply)
        admitted = turn.admitted
        if admitted is not None and not admitted.done():
            if out.early is not None:
                admitted.set_exception(out.early)
            else:
                admitted.set_result(None)
        turn.done = True
        turn.publish(_END)
        turn.followers.clear()

    def _rewarm(self, turn: LiveTurn, reply: dict[str, Any]) -> None:
        """In the background: prefill the history as the next prompt will start (rewarm.py)."""
        msgs = [*turn.messages, history_message({"role": "assistant", **reply})]
        task = asyncio.get_running_loop().create_task(
            self.backend.rewarm(self.state, msgs, owner=turn.cache_owner, request_id=turn.request_id + "-rewarm",
                                model=turn.model or None))
        self.rewarming.add(task)
        task.add_done_callback(self.rewarming.discard)

    async def _finish(self, turn: LiveTurn, msg: dict[str, Any] | None) -> None:
        """Store the reply (or drop its placeholder) and clear the session's turn marker."""
        def apply(s: Session) -> None:
            node = s.nodes.get(turn.message_id)
            if node is not None:
                if msg is None:
                    s.remove(turn.message_id)
                else:
                    node.pop("status", None)
                    node.update(msg)
            if s.turn and s.turn.get("id") == turn.id:
                s.turn = None

        try:
            await self.store.update(turn.owner, turn.session_id, apply)
        except Exception as e:               # StoreUnavailable: the reply was streamed but not kept
            log.error("session %s: reply not stored: %s", turn.session_id, e)
        finally:
            if self.by_session.get(turn.session_id) is turn:
                del self.by_session[turn.session_id]

    async def _tick(self, turn: LiveTurn) -> None:
        """Progress events until the first token; the partial reply and heartbeat saved periodically."""
        saved_len, saved_at = 0, time.monotonic()
        while True:
            await asyncio.sleep(TICK_S)
            served = self.state.models.peek(turn.model or None)
            if not turn.text and not turn.reasoning and served is not None:
                p = served.engine.progress(turn.request_id)
                if p is not None:
                    ev = {"object": "chatserve.turn.progress", "turn_id": turn.id, **p}
                    if ev != turn.progress:
                        turn.progress = ev
                        turn.phase = p.get("phase", turn.phase)
                        turn.publish(ev)
            now = time.monotonic()
            n = sum(len(x) for x in turn.text) + sum(len(x) for x in turn.reasoning)
            if now - saved_at >= SAVE_EVERY_S and (n != saved_len or now - saved_at >= HEARTBEAT_S):
                saved_len, saved_at = n, now
                await self._save_partial(turn)

    async def _save_partial(self, turn: LiveTurn) -> None:
        """Save the reply so far. The write runs to its end even when the turn ends meanwhile (the
        ticker is cancelled): a write cancelled while Redis runs it lands without the store knowing,
        and the reply saved after it could then be refused as not newer."""
        text, reasoning, phase = "".join(turn.text), "".join(turn.reasoning), turn.phase

        def apply(s: Session) -> None:
            node = s.nodes.get(turn.message_id)
            if node is not None and node.get("status") == "generating":
                node["content"] = text
                if reasoning:
                    node["reasoning_content"] = reasoning
            if s.turn and s.turn.get("id") == turn.id:
                s.turn.update(heartbeat=time.time(), phase=phase)

        turn.saving = asyncio.ensure_future(self.store.update(turn.owner, turn.session_id, apply))
        try:
            await asyncio.shield(turn.saving)
        except StoreUnavailable as e:
            log.debug("session %s: partial reply not saved: %s", turn.session_id, e)


def _chat_key(s: Session, history: list[dict[str, Any]]) -> tuple[Any, ...]:
    return [history_message(m) for m in history], s.params, s.system_prompt, s.model


def _add_turn(s: Session, treq: TurnRequest, turn: LiveTurn, user_id: str | None,
              reply_id: str) -> list[dict[str, Any]]:
    """Add the user's message (a new version when editing) and the placeholder reply; set the turn
    marker. Returns the history the reply answers. Raises APIError when there is nothing to answer."""
    path = s.path()
    start = treq.replace_from
    if treq.edit_id is not None:
        ids = [m["id"] for m in path]
        if treq.edit_id not in ids:
            raise invalid("edit_id is not a message of the active branch", "edit_id", "message_not_found")
        start = ids.index(treq.edit_id)
    if start is not None:
        if start > len(path):
            raise invalid("replace_from is past the end of the conversation", "replace_from")
        base = path[:start]
    else:
        base = list(path)
        if treq.content is None:                         # regenerate: a new version of the reply
            while base and base[-1]["role"] == "assistant":
                base.pop()
    parent = base[-1]["id"] if base else ROOT
    if treq.content is not None:
        user = s.add_message({"role": "user", "content": treq.content}, parent=parent, node_id=user_id)
        base.append(user)
        parent = user["id"]
        if s.title == "New chat" and sum(m["role"] == "user" for m in base) == 1:
            s.title = " ".join(treq.content.split())[:60] or "New chat"
    if not base or base[-1]["role"] != "user":
        raise invalid("nothing to answer: the conversation must end with a user message", None)
    s.add_message({"role": "assistant", "content": "", "status": "generating"}, parent=parent,
                  node_id=reply_id)
    turn.parent_id = parent
    s.turn = {"id": turn.id, "message_id": reply_id, "phase": "queued", "heartbeat": time.time()}
    return base


def usage_record(usage: dict[str, Any] | None, t0: float, first: float | None, n_content: int) -> dict[str, Any]:
    """The per-turn usage kept with a reply: tokens, cached tokens, TTFT, speed, queue time."""
    now = time.perf_counter()
    u: dict[str, Any] = {}
    if usage:
        u["prompt_tokens"] = usage.get("prompt_tokens")
        u["completion_tokens"] = usage.get("completion_tokens")
        u["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        extra = usage.get("chatserve") or {}
        for k in ("ttft_s", "tokens_per_s", "queue_s"):
            if extra.get(k) is not None:
                u[k] = extra[k]
        u["reasoning_tokens"] = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens")
    if u.get("completion_tokens") is None:
        u["completion_tokens"] = n_content          # stopped early: no usage chunk came
    if "ttft_s" not in u and first is not None:
        u["ttft_s"] = round(first - t0, 4)
    if "tokens_per_s" not in u and first is not None and now > first and u["completion_tokens"] > 1:
        u["tokens_per_s"] = round((u["completion_tokens"] - 1) / (now - first), 2)
    return {k: v for k, v in u.items() if v is not None}
