"""Evaluation during training (`training.eval_every` with `training.eval`): what `meshforge eval` measures, on the
live model every `eval_every` steps and at the last step, logged as one record ({"step", "eval/loss", "eval/ppl",
"eval/<task>/<metric>"...}) to metrics.jsonl and every logger.

- `eval.paths`: perplexity on held-out files read with the training data's settings (source, format, tokenizer,
  loss masking, packing), every sample once in order (`evaluation/perplexity.py`), as `meshforge eval RUN
  data.*=<the same settings> data.paths=[...]` reads them;
- `eval.tasks`: lm-eval tasks from the `eval.include` folders (local files only) through `MeshforgeLM`
  (`evaluation/harness.py`), its forwards on the live model.

Every rank runs the whole evaluation on the same inputs (the model is sharded as training holds it: FSDP, TP, EP,
so every rank joins every forward) and gets the same numbers; rank 0 logs them. It runs `apart_from_training`, as
samples do (training/samples.py): eval mode, no grad, every RNG forked, the data loader untouched, so the losses
and an exact resume are unchanged (tests/parallel/test_eval_training.py). It runs at training's precision
(under bf16 autocast the numbers are bf16's, `meshforge eval` on the checkpoint reads fp32). Pipeline and context
parallelism are refused by a rule (`live_model_support`).
"""

from __future__ import annotations

import time

from meshforge.data import build_source
from meshforge.errors import MeshforgeError
from meshforge.evaluation.model import EvalModel
from meshforge.generation.decode import Sampling, generate_live
from meshforge.models import resolve_model_args
from meshforge.training.samples import apart_from_training, live_forward, run_tokenizer


class Evaluation:
    def __init__(self, cfg, pm, em: EvalModel, data_cfg, lm):
        t, e = cfg.training, cfg.training.eval
        self.pm, self.em, self.data_cfg, self.lm = pm, em, data_cfg, lm
        self.every, self.max_steps, self.seq_len, self.batch = t.eval_every, t.max_steps, t.seq_len, t.micro_batch_size
        self.tasks, self.include, self.limit = list(e.tasks), list(e.include), e.limit
        d = cfg.distributed
        self.forward = live_forward(pm, d.tp_size if d.sequence_parallel else 1, em.tokenizer.pad_id)

    @classmethod
    def build(cls, cfg, pm) -> Evaluation | None:
        """None without `training.eval`; what it reads (tokenizer, held-out files, task folders and files) is checked
        here, before the first step: one line each."""
        e = cfg.training.eval
        if e is None:
            return None
        args = resolve_model_args(cfg.model)
        try:
            tok, recorded = run_tokenizer(cfg, "training.eval", "to read its tasks and files")
            data_cfg = cfg.data.model_copy(update={"paths": list(e.paths), "validation": None})
            if e.paths:  # the held-out files read now: a missing or malformed file stops the run before it starts
                build_source(data_cfg, cfg.training.seq_len, args.vocab_size, 0)
            if e.tasks:
                from meshforge.evaluation.harness import check_tasks, make_lm

                check_tasks(e.tasks, e.include, e.limit, "training.eval", "training.eval.include")
        except MeshforgeError as err:
            lines = [p.replace("data.paths", "training.eval.paths") for p in err.problems]
            raise type(err)([p if p.startswith("training.eval") else f"training.eval: {p}" for p in lines]) from None
        em = EvalModel(pm.model, args, tok, None if recorded == "bytes" else recorded, "the live model")
        ev = cls(cfg, pm, em, data_cfg, None)
        if e.tasks:
            ev.lm = make_lm(em, forward=ev.forward, decode=ev._decode)
        return ev

    def due(self, step: int) -> bool:
        return step % self.every == 0 or step == self.max_steps

    def __call__(self, step: int, result, log) -> float:
        """Evaluate, record in `result.evaluations` and the log; returns the seconds it took (not training time)."""
        t0 = time.perf_counter()
        record = {"step": step, **self.run()}
        result.evaluations.append(record)
        log.log(record)
        return time.perf_counter() - t0

    def run(self) -> dict:
        out = {}
        with apart_from_training(self.pm):
            if self.data_cfg.paths:
                from meshforge.evaluation.perplexity import perplexity

                r = perplexity(self.em, self.data_cfg, self.seq_len, self.batch, forward=self.forward)["data"]
                out.update({"eval/loss": r["loss"], "eval/ppl": r["ppl"]})
            if self.tasks:
                from meshforge.evaluation.harness import run_tasks

                for task, metrics in run_tasks(self.lm, self.tasks, self.include, self.limit).items():
                    out.update({f"eval/{task}/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))})
        return out

    def _decode(self, ids: list[int], max_new: int, stop_ids: set[int]) -> list[int]:
        """Greedy tokens from the live model (lm-eval's generate_until): the whole sequence each token, as samples."""
        return generate_live(self.forward, ids, max_new, Sampling(), stop_ids, self.em.args.max_seq_len,
                             self.pm.device)
