"""Supervised fine-tuning examples: one record -> one sequence with a label mask.

- `prompt_completion`: records {prompt, completion}; tokens = prompt + completion + EOS (each encoded on its own).
- `chat`: records {messages: [{role, content}, ...]} rendered by the tokenizer's own chat template (transformers,
  jinja2). An assistant turn's text is the span between the conversation rendered up to it with the generation
  prompt and the conversation rendered through it; tokens whose first character lies in such a span are the
  answer. A template whose renders are not prefixes of each other cannot be masked this way: refused.

`loss_on: answer` puts labels only on answer tokens (completion + EOS; assistant turns), `all` on every token.
A sequence longer than `seq_len + 1` tokens is cut to its first `seq_len + 1` tokens (`too_long: truncate`) or
left out of the data set (`drop`); shorter ones are padded with labels of -100. Each example is one sample, so
the loader's guarantees (global batch k the same at any world size, exact resume) hold unchanged.
"""

from __future__ import annotations

import hashlib

import numpy as np

from meshforge.data.records import field, iter_records
from meshforge.errors import DataError

IGNORE_INDEX = -100  # no loss here: the torch / Hugging Face convention (models.loss reads the same value)


def prompt_completion(rec: dict, where: str, tok, loss_on: str) -> tuple[list[int], list[bool]]:
    prompt = tok.encode(field(rec, "prompt", where))
    answer = tok.encode(field(rec, "completion", where)) + [tok.eos_id]
    return prompt + answer, [loss_on == "all"] * len(prompt) + [True] * len(answer)


def chat(rec: dict, where: str, tok, loss_on: str) -> tuple[list[int], list[bool]]:
    messages = field(rec, "messages", where, list)
    if not messages:
        raise DataError(f"data: {where} has an empty messages list")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"data: {where}: every message needs a string 'role' and 'content' (got {m!r:.80})")
    full = tok.render_chat(messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prefix = tok.render_chat(messages[:i], add_generation_prompt=True)
        through = tok.render_chat(messages[:i + 1])
        if not (through.startswith(prefix) and full.startswith(through)):
            raise DataError(f"data: {where}: the chat template's renders are not prefixes of each other, so the "
                            "assistant turns cannot be located; use data.loss_on=all or another template")
        spans.append((len(prefix), len(through)))
    if loss_on == "answer" and not spans:
        raise DataError(f"data: {where} has no assistant message, so nothing to learn with data.loss_on=answer")
    ids, offsets = tok.encode_with_offsets(full)
    mask = [loss_on == "all" or any(a <= s < b for a, b in spans) for s, _ in offsets]
    return ids, mask


FORMATS = {"prompt_completion": prompt_completion, "chat": chat}


class ExampleSource:
    """Fixed-length samples of (inputs, labels) built from examples; `labels` is -100 where there is no loss."""

    def __init__(self, paths, fmt: str, tok, seq_len: int, loss_on: str, too_long: str):
        self.seq_len, self.name = seq_len, f"{fmt}:" + ",".join(str(p) for p in paths)
        n = seq_len + 1
        tokens, masks, h = [], [], hashlib.sha256(f"{fmt}:{loss_on}:{too_long}:{seq_len}".encode())
        self.dropped = 0
        for where, rec in iter_records(paths):
            ids, mask = FORMATS[fmt](rec, where, tok, loss_on)
            if len(ids) > n:
                if too_long == "drop":
                    self.dropped += 1
                    continue
                ids, mask = ids[:n], mask[:n]
            row = np.full(n, tok.pad_id, dtype=np.int64)
            row[:len(ids)] = ids
            m = np.zeros(n, dtype=bool)
            m[:len(mask)] = mask
            tokens.append(row)
            masks.append(m)
            h.update(row.tobytes() + m.tobytes())
        if not tokens:
            raise DataError(f"data: no example fits training.seq_len+1={n} tokens ({self.dropped} dropped by "
                            "data.too_long=drop); raise training.seq_len or use data.too_long=truncate")
        self.tokens, self.masks = np.stack(tokens), np.stack(masks)
        self.num_samples = len(tokens)
        self._digest = h.hexdigest()[:16]

    def batch(self, indices: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, labels), each (len(indices), seq_len): labels are the next token where it carries loss."""
        idx = np.asarray(indices) % self.num_samples
        toks, masks = self.tokens[idx], self.masks[idx]
        labels = np.where(masks[:, 1:], toks[:, 1:], IGNORE_INDEX)
        return toks[:, :-1], labels

    def max_token(self) -> int:
        return int(self.tokens.max())

    def digest(self) -> str:
        return self._digest
