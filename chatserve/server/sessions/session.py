"""A chat session: settings plus a tree of messages (edits and regenerations are sibling versions),
with one active branch, and the running turn's marker. Reads every stored schema (v1: a flat list).

No storage and no HTTP here (see store.py and routes.py).
"""
from __future__ import annotations

import copy
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

SCHEMA = 2
TURN_STALE_S = 20.0          # a turn whose heartbeat is older than this died with its process
ROOT = ""                    # the parent id of first messages
MESSAGE_FIELDS = ("role", "content", "reasoning_content", "created", "usage", "finish_reason", "error", "status")


def new_message_id() -> str:
    return "m_" + secrets.token_urlsafe(9)


@dataclass
class Session:
    id: str
    owner: str
    title: str = "New chat"
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)
    model: str | None = None
    system_prompt: str = ""
    params: dict[str, Any] = field(default_factory=dict)
    # every message ever written, oldest first: {"id", "parent", "role", "content", "created", "n"}
    # + for replies "usage", "finish_reason", "error", "reasoning_content" (the thinking, apart from
    # the answer, when the model's reasoning parser found some), and "status": "generating" while written
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    active: dict[str, str] = field(default_factory=dict)     # parent id → the child shown
    turn: dict[str, Any] | None = None   # {"id", "message_id", "phase", "heartbeat"} while generating
    rev: int = 0                          # bumped by every write; Redis keeps the highest
    _next_n: int = field(default=-1, repr=False, compare=False)

    # ── (de)serialisation ─────────────────────────────────────────────────────────────────────
    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "id": self.id, "owner": self.owner, "title": self.title,
                "created": self.created, "updated": self.updated, "model": self.model,
                "system_prompt": self.system_prompt, "params": copy.deepcopy(self.params),
                "nodes": [copy.deepcopy(n) for n in self.nodes.values()],
                "active": dict(self.active), "turn": copy.deepcopy(self.turn), "rev": self.rev}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Session":
        """Any stored schema. v1 (no "schema": a flat `messages` list) becomes one branch whose ids
        are derived from the positions, so every process migrating the same record agrees on them."""
        s = cls(id=d["id"], owner=d["owner"])
        for k in ("title", "created", "updated", "model", "system_prompt", "params", "rev", "turn"):
            if k in d:
                setattr(s, k, d[k])
        if "nodes" in d:
            for n in d["nodes"]:
                s.nodes[n["id"]] = n
            s.active = dict(d.get("active") or {})
        else:
            parent = ROOT
            for i, m in enumerate(d.get("messages") or []):
                node = s._new_node(parent, m, node_id=f"m_v1-{i}")
                parent = node["id"]
        return s

    def clone(self) -> "Session":
        return copy.deepcopy(self)

    # ── the tree ──────────────────────────────────────────────────────────────────────────────
    def _new_node(self, parent: str, msg: dict[str, Any], node_id: str | None = None) -> dict[str, Any]:
        if self._next_n < 0:
            self._next_n = max((x.get("n", 0) for x in self.nodes.values()), default=-1) + 1
        node: dict[str, Any] = {"id": node_id or new_message_id(), "parent": parent, "n": self._next_n}
        self._next_n += 1
        node.update({k: msg[k] for k in MESSAGE_FIELDS if k in msg})
        node.setdefault("created", time.time())
        self.nodes[node["id"]] = node
        self.active[parent] = node["id"]
        return node

    def add_message(self, msg: dict[str, Any], parent: str | None = None,
                    node_id: str | None = None) -> dict[str, Any]:
        """Add a message under `parent` (default: the end of the active branch) and make it active."""
        if parent is None:
            path = self.path()
            parent = path[-1]["id"] if path else ROOT
        return self._new_node(parent, msg, node_id)

    def children_index(self) -> dict[str, list[dict[str, Any]]]:
        """parent id → its children, oldest first (one pass; the tree is walked with it)."""
        out: dict[str, list[dict[str, Any]]] = {}
        for n in sorted(self.nodes.values(), key=lambda n: n.get("n", 0)):
            out.setdefault(n.get("parent", ROOT), []).append(n)
        return out

    def path(self, index: dict[str, list[dict[str, Any]]] | None = None) -> list[dict[str, Any]]:
        """The active branch, root to leaf: at each level the selected child, else the newest."""
        index = self.children_index() if index is None else index
        out: list[dict[str, Any]] = []
        parent, seen = ROOT, set()
        while parent not in seen:
            seen.add(parent)
            kids = index.get(parent)
            if not kids:
                break
            chosen = self.nodes.get(self.active.get(parent, ""))
            node = chosen if chosen is not None and chosen.get("parent") == parent else kids[-1]
            out.append(node)
            parent = node["id"]
        return out

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The active branch's messages (the live node dicts)."""
        return self.path()

    def select(self, message_id: str) -> bool:
        """Make the branch through `message_id` active. False when there is no such message."""
        node = self.nodes.get(message_id)
        if node is None:
            return False
        seen = set()
        while node is not None and node["id"] not in seen:
            seen.add(node["id"])
            self.active[node["parent"]] = node["id"]
            node = self.nodes.get(node["parent"])
        return True

    def remove(self, message_id: str) -> None:
        """Drop one leaf message (a reply that never started); its parent's newest child shows."""
        node = self.nodes.pop(message_id, None)
        if node is not None and self.active.get(node["parent"]) == message_id:
            del self.active[node["parent"]]

    # ── views ─────────────────────────────────────────────────────────────────────────────────
    def turn_live(self, now: float | None = None) -> bool:
        t = self.turn
        if not t:
            return False
        return (now or time.time()) - float(t.get("heartbeat", 0)) < TURN_STALE_S

    def public_messages(self) -> list[dict[str, Any]]:
        live = self.turn_live()
        index = self.children_index()
        out = []
        for node in self.path(index):
            m = {k: v for k, v in node.items() if k != "n"}
            m["parent"] = node["parent"] or None
            sibs = [x["id"] for x in index[node["parent"]]]
            m["versions"], m["version"] = sibs, sibs.index(node["id"])
            if m.get("status") == "generating":
                if live and self.turn and self.turn.get("message_id") == node["id"]:
                    m["finish_reason"] = None
                else:
                    m.pop("status")
                    m["finish_reason"] = "interrupted"
            out.append(m)
        return out

    def public(self) -> dict[str, Any]:
        """The session as GET shows it: settings, the active branch with versions, the turn."""
        live = self.turn_live()
        return {"id": self.id, "object": "session", "title": self.title, "created": self.created,
                "updated": self.updated, "model": self.model, "system_prompt": self.system_prompt,
                "params": copy.deepcopy(self.params), "rev": self.rev,
                "messages": self.public_messages(), "generating": live,
                "turn": ({k: self.turn[k] for k in ("id", "message_id", "phase") if k in self.turn}
                         if live and self.turn else None)}

    def summary(self) -> dict[str, Any]:
        """The list view: everything but the messages."""
        return {"id": self.id, "object": "session", "title": self.title, "created": self.created,
                "updated": self.updated, "model": self.model, "system_prompt": self.system_prompt,
                "params": copy.deepcopy(self.params), "rev": self.rev,
                "num_messages": len(self.path()), "generating": self.turn_live()}

    def tree(self) -> dict[str, Any]:
        """Every version, for export: nodes oldest first (without the internal order) and the leaf."""
        path = self.path()
        return {"nodes": [{**{k: v for k, v in n.items() if k != "n"}, "parent": n["parent"] or None}
                          for n in sorted(self.nodes.values(), key=lambda n: n.get("n", 0))],
                "active": path[-1]["id"] if path else None}


def chat_messages(s: Session, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The session's system prompt and stored history as the chat template gets them."""
    system = [{"role": "system", "content": s.system_prompt}] if s.system_prompt else []
    return system + [history_message(m) for m in history]


def history_message(m: dict[str, Any]) -> dict[str, Any]:
    """A stored message as the chat template gets it: an assistant reply keeps its reasoning apart, as
    `reasoning_content`, and the template decides whether the next prompt shows it (Qwen3 and
    DeepSeek-R1 drop it from earlier turns; a template that keeps thinking in history writes it)."""
    out = {"role": m["role"], "content": m["content"]}
    if m["role"] == "assistant" and m.get("reasoning_content"):
        out["reasoning_content"] = m["reasoning_content"]
    return out
