"""Samples during training (`logging.samples`): each prompt's continuation from the live model every `every` steps
and at the last step, logged as one `samples` record ({"step", "samples": [{"prompt", "completion"}]}) to
metrics.jsonl and every logger (a text table in TensorBoard, a table in W&B, a JSON artifact in MLflow).

The model is the one training holds, sharded as it is (FSDP, TP, EP): every rank runs the same decoding loop on the
same prompts with the same seed (`generation.decode.generate_live`: the whole sequence each token, no KV cache, so
nothing about the sharded forward changes; with sequence parallelism the sequence is right-padded to a multiple of
tp_size), and identical logits on every rank (TP's are gathered) give identical tokens, so every rank runs the same
forwards. It runs in eval mode under `torch.no_grad` with the RNG forked and its own seeded generator, and never
touches the data loader: the training that follows, and an exact resume, are unchanged (tests/parallel/
test_samples.py). Pipeline and context parallelism are refused by a rule (`samples_support`).
"""

from __future__ import annotations

import time

import torch

from meshforge.checkpoint.hf import tokenizer_of
from meshforge.data.tokenizer import ByteTokenizer, check_vocab, load_tokenizer
from meshforge.errors import ConfigError, MeshforgeError
from meshforge.generation.prompts import check_prompts, encode_prompts
from meshforge.generation.decode import Sampling, generate_live
from meshforge.models import resolve_model_args


class Samples:
    def __init__(self, cfg, pm, tokenizer, prompt_ids: list[list[int]]):
        s = cfg.logging.samples
        self.pm, self.tokenizer, self.prompt_ids, self.prompts = pm, tokenizer, prompt_ids, list(s.prompts)
        self.every, self.max_steps, self.max_new = s.every, cfg.training.max_steps, s.max_new_tokens
        self.sampling = Sampling(s.temperature, s.top_k, s.top_p, s.seed)
        args = resolve_model_args(cfg.model)
        eos = args.eos_token_id
        self.stop_ids = {tokenizer.eos_id, *(eos if isinstance(eos, list) else [] if eos is None else [eos])}
        self.context = args.max_seq_len
        d = cfg.distributed
        self.pad_to = d.tp_size if d.sequence_parallel else 1

    @classmethod
    def build(cls, cfg, pm) -> Samples | None:
        """None without `logging.samples`; a run without a tokenizer to read the prompts with is one line."""
        s = cfg.logging.samples
        if s is None:
            return None
        recorded = tokenizer_of(cfg)
        if recorded is None:
            raise ConfigError(["logging.samples needs a tokenizer to read its prompts: set data.tokenizer"])
        try:
            tok = ByteTokenizer() if recorded == "bytes" else load_tokenizer(recorded)
            check_vocab(tok, resolve_model_args(cfg.model).vocab_size)
            ids = encode_prompts(s.prompts, tok, s.chat)
            check_prompts(ids, resolve_model_args(cfg.model).max_seq_len, what="logging.samples prompt")
        except MeshforgeError as err:
            raise ConfigError([p if p.startswith("logging.samples") else f"logging.samples: {p}"
                               for p in err.problems]) from None
        return cls(cfg, pm, tok, ids)

    def due(self, step: int) -> bool:
        return step % self.every == 0 or step == self.max_steps

    def __call__(self, step: int, result, log) -> float:
        """Generate, record in `result.samples` and the log; returns the seconds it took (not training time)."""
        t0 = time.perf_counter()
        record = {"step": step, "samples": self.run()}
        result.samples.append(record)
        log.log(record)
        return time.perf_counter() - t0

    def run(self) -> list[dict]:
        pm = self.pm
        devices = [pm.device] if pm.device.type == "cuda" else []

        def forward(x: torch.Tensor):
            with pm.autocast():
                return pm.model(x)

        out = []
        pm.eval()
        try:
            with torch.random.fork_rng(devices=devices):
                for prompt, ids in zip(self.prompts, self.prompt_ids):
                    new = generate_live(forward, ids, self.max_new, self.sampling, self.stop_ids, self.context,
                                        pm.device, pad_to=self.pad_to, pad_id=self.tokenizer.pad_id)
                    text = self.tokenizer.decode([t for t in new if t not in self.stop_ids])
                    out.append({"prompt": prompt, "completion": text})
        finally:
            pm.train()
        return out
