"""Prompts for generation: read (`--prompt`, `--prompts-file`), through the chat template, checked against the
model's context. Shared by `meshforge generate` and training's samples; problems are one line (MeshforgeError)."""

from __future__ import annotations

import json
from pathlib import Path

from meshforge.errors import MeshforgeError


def read_prompts(given: list[str], prompts_file: str | None) -> list:
    """Strings, or chat message lists (from a .jsonl file's `messages`)."""
    out: list = list(given)
    if prompts_file:
        path = Path(prompts_file)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise MeshforgeError(f"--prompts-file {path}: cannot read it ({getattr(err, 'strerror', None) or err})") \
                from None
        if path.suffix == ".jsonl":
            for n, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    rec = None
                item = rec.get("messages", rec.get("prompt")) if isinstance(rec, dict) else None
                if not (isinstance(item, str) or isinstance(item, list) and all(
                        isinstance(m, dict) and isinstance(m.get("content"), str) for m in item)):
                    raise MeshforgeError(f"--prompts-file {path} line {n}: not an object with a string `prompt` or a "
                                         "`messages` list of {role, content}")
                out.append(item)
        else:
            out += [line for line in text.splitlines() if line.strip()]
    if not out:
        raise MeshforgeError("no prompt: give --prompt TEXT (repeatable) or --prompts-file FILE")
    return out


def encode_prompts(prompts: list, tokenizer, chat: bool | None) -> list[list[int]]:
    """Token ids of each prompt, through the chat template when asked or (chat None) when the tokenizer has one."""
    has_template = bool(getattr(tokenizer, "has_chat_template", False))
    if chat and not has_template or not has_template and any(isinstance(p, list) for p in prompts):
        raise MeshforgeError(f"chat asked for, but the tokenizer {tokenizer.name!r} has no chat template: pass "
                             "--no-chat and plain prompts, or a --tokenizer with one")
    use = has_template if chat is None else chat
    out = []
    for p in prompts:
        if use or isinstance(p, list):
            p = tokenizer.render_chat(p if isinstance(p, list) else [{"role": "user", "content": p}],
                                      add_generation_prompt=True)
        out.append(tokenizer.encode(p))
    return out


def check_prompts(ids: list[list[int]], context: int, what: str = "prompt") -> None:
    for i, p in enumerate(ids, 1):
        if not p:
            raise MeshforgeError(f"{what} {i} is empty (no tokens)")
        if len(p) >= context:
            raise MeshforgeError(f"{what} {i} is {len(p)} tokens, but the model's context is {context} "
                                 "(model.max_seq_len): shorten it to leave room for the answer")
