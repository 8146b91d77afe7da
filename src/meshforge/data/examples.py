"""Supervised fine-tuning examples: one record -> one sequence with a label mask.

- `prompt_completion`: records {prompt, completion}; tokens = prompt + completion + EOS (each encoded on its own).
- `chat`: records {messages: [{role, content}, ...]} rendered by the tokenizer's own chat template (transformers,
  jinja2). An assistant turn's text is the span between the conversation rendered up to it with the generation
  prompt and the conversation rendered through it; tokens whose first character lies in such a span are the
  answer. A template whose renders are not prefixes of each other cannot be masked this way: refused.

`loss_on: answer` puts labels only on answer tokens (completion + EOS; assistant turns), `all` on every token.
A sequence longer than `seq_len + 1` tokens is cut to its first `seq_len + 1` tokens (`too_long: truncate`) or
left out of the data set (`drop`); shorter ones are padded with labels of -100. An example left with no label
token (its answer lies beyond `seq_len + 1` tokens) is left out too, so every sample, and every global batch,
carries label tokens: none trains on nothing with a loss of 0. What was dropped, truncated and left out is
counted (`report`, logged at start); when fewer than `MIN_KEPT` (10%) of the examples read remain, the source
is refused in one line. Each example is one sample, so the loader's guarantees (global batch k the same at any
world size, exact resume) hold unchanged.

`packing`: examples are packed, in data order, into rows of `seq_len + 1` tokens (an example that does not fit in
what is left of a row starts the next one); a row is then one sample, with document ids 0, 1, ... (padding has id
-1: it is in no document, attends only to padding, and an MoE leaves it out of its router statistics). The last
token of a document gets no label (it would predict the next document), so a packed row's labels are exactly its
examples' unpacked labels; the model's document mask and restarting positions make the logits equal too.
"""

from __future__ import annotations

import hashlib

import numpy as np

from meshforge.data import fingerprint
from meshforge.data.records import field, iter_records
from meshforge.errors import DataError

IGNORE_INDEX = -100  # no loss here: the torch / Hugging Face convention (models.loss reads the same value)
MIN_KEPT = 0.1  # fewer examples left than this share of those read: refused (docs/data.md)


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
    """Fixed-length samples of (inputs, labels[, document ids]) built from examples; labels are -100 where there
    is no loss."""

    def __init__(self, paths, fmt: str, tok, seq_len: int, loss_on: str, too_long: str, packing: bool = False):
        self.seq_len, self.name, self.packing = seq_len, f"{fmt}:" + ",".join(str(p) for p in paths), packing
        n = seq_len + 1
        h = hashlib.sha256(f"{fmt}:{loss_on}:{too_long}:{seq_len}:{packing}".encode())
        self.read = self.dropped = self.truncated = self.unlabelled = 0
        examples = []
        for where, rec in iter_records(paths):
            self.read += 1
            ids, mask = FORMATS[fmt](rec, where, tok, loss_on)
            if len(ids) > n:
                if too_long == "drop":
                    self.dropped += 1
                    continue
                ids, mask = ids[:n], mask[:n]
                self.truncated += 1
            if not any(mask[1:]):  # a label predicts token t+1 from t: the first token is never one
                self.unlabelled += 1
                continue
            examples.append((ids, mask))
        self.report = self._report(paths, n, too_long, len(examples))
        if len(examples) < max(1, MIN_KEPT * self.read):
            raise DataError(f"data: {self.report.removeprefix('data: ')}: {'none' if not examples else 'too few'} "
                            f"left to train on (meshforge refuses fewer than {MIN_KEPT:.0%}); raise "
                            "training.seq_len, shorten the examples, or use data.too_long=truncate")
        rows = [[e] for e in examples]
        if packing:
            rows, used = [], n
            for e in examples:
                if used + len(e[0]) > n:
                    rows.append([])
                    used = 0
                rows[-1].append(e)
                used += len(e[0])
        self.tokens = np.full((len(rows), n), tok.pad_id, dtype=np.int64)
        self.masks = np.zeros((len(rows), n), dtype=bool)
        self.docs = np.zeros((len(rows), n), dtype=np.int64)
        for r, row in enumerate(rows):
            at = 0
            for d, (ids, mask) in enumerate(row):
                self.tokens[r, at:at + len(ids)], self.masks[r, at:at + len(ids)] = ids, mask
                self.docs[r, at:at + len(ids)] = d
                at += len(ids)
            self.docs[r, at:] = len(row)  # padding: a document of its own here, id -1 in batches
        for a in (self.tokens, self.masks, self.docs):  # the arrays' own buffers: no copy of the data set
            h.update(a)
        self.num_samples = len(rows)
        self.n_docs = np.array([len(row) for row in rows], dtype=np.int64)  # padding's stored id, per row
        self.inputs = {**fingerprint.files("data.paths", paths), **tok.fingerprint(),
                       **fingerprint.settings(format=fmt, loss_on=loss_on, too_long=too_long, packing=packing,
                                              seq_len=seq_len),
                       "data examples (tokenized)": f"rows={len(rows)} sha256={h.hexdigest()[:32]}"}

    def _report(self, paths, n: int, too_long: str, kept: int) -> str | None:
        """One line on what did not reach training as it was written (None when everything did)."""
        if not (self.dropped or self.truncated or self.unlabelled):
            return None
        parts = ([f"{self.dropped} dropped (longer than training.seq_len+1={n} tokens, data.too_long={too_long})"]
                 if self.dropped else []) + \
                ([f"{self.truncated} truncated to {n} tokens"] if self.truncated else []) + \
                ([f"{self.unlabelled} left out (no answer token within the first {n} tokens)"]
                 if self.unlabelled else [])
        return f"data: {self.read} examples in {', '.join(map(str, paths))}: {', '.join(parts)}; {kept} remain"

    def batch(self, indices: list[int]) -> tuple[np.ndarray, ...]:
        """(inputs, labels[, document ids]), each (len(indices), seq_len): a label is the next token where it
        carries loss and belongs to the same document."""
        idx = np.asarray(indices) % self.num_samples
        toks, masks, docs = self.tokens[idx], self.masks[idx], self.docs[idx]
        keep = masks[:, 1:] & (docs[:, 1:] == docs[:, :-1])
        labels = np.where(keep, toks[:, 1:], IGNORE_INDEX)
        if not self.packing:
            return toks[:, :-1], labels
        docs = np.where(docs == self.n_docs[idx][:, None], -1, docs)  # padding: in no document
        return toks[:, :-1], labels, docs[:, :-1]

    def max_token(self) -> int:
        return int(self.tokens.max())

    def digest(self) -> str:
        return fingerprint.digest(self.inputs)
