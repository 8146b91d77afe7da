"""lm-eval-harness on a meshforge model (extra `eval`: pip install 'meshforge[eval]').

`MeshforgeLM` is lm-eval's model API over one process's plain model: `loglikelihood` (lm-eval's `TemplateLM`
splits context and continuation as it does for Hugging Face models: the whole string encoded, the context's
tokens cut off), `loglikelihood_rolling` (lm-eval's disjoint rolling windows of the model's context, as HFLM),
and `generate_until` (greedy, `greedy_until` below: `meshforge generate`'s decoding loop with its KV cache).
Requests are scored one sequence at a time, in fp32, so
scores do not depend on batching or padding.

Tasks come from local files only: `--tasks` names tasks in `--include` folders of lm-eval task YAML (its
`dataset_path: json` with `data_files` reads local jsonl); datasets and hub are set offline, so nothing is
downloaded, and a task lm-eval cannot find is one line.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from meshforge.errors import ConfigError
from meshforge.generation.decode import Sampling, generate_ids


def _lm_eval():
    try:
        import lm_eval  # noqa: F401
        from lm_eval.api.model import TemplateLM
    except ImportError:
        raise ConfigError("meshforge eval --tasks needs lm-eval: pip install 'meshforge[eval]'") from None
    return TemplateLM


def greedy_until(model, ids: list[int], max_new: int, max_len: int, stop_ids: set[int]) -> list[int]:
    """Greedy continuation of `ids` by generation's decoding loop (KV cache, `generation/decode.py`), the prompt
    cut on the left to leave room for `max_new` tokens in the model's `max_len` (as lm-eval's HF model does); stops
    at a token of `stop_ids` (not returned) or after `max_new` tokens."""
    keep = max(max_len - max_new, 1)
    out = generate_ids(model, [ids[-keep:]], max_new, Sampling(), stop_ids, max_len)[0]
    return out[:-1] if out and out[-1] in stop_ids else out


def make_lm(em, max_length: int | None = None, max_gen_toks: int = 256):
    """A `MeshforgeLM` (lm-eval's TemplateLM) over an `EvalModel` (`evaluation/model.py`)."""
    TemplateLM = _lm_eval()
    from lm_eval import utils

    class MeshforgeLM(TemplateLM):
        backend = "causal"

        def __init__(self):
            super().__init__()
            self.em, self.model = em, em.model
            self.max_length = max_length or em.args.max_seq_len
            self.max_gen_toks = max_gen_toks

        @property
        def eot_token_id(self) -> int:
            return self.em.tokenizer.eos_id

        def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
            return self.em.tokenizer.encode(string)

        def tok_decode(self, ids: list[int]) -> str:
            return self.em.tokenizer.decode(ids, skip_special=True)

        @torch.no_grad()
        def _logprobs(self, inp: list[int], n: int) -> torch.Tensor:
            """Log-probabilities (n, vocab) of the model at the last n positions of `inp`."""
            x = torch.tensor([inp], device=next(self.model.parameters()).device)
            return F.log_softmax(self.model(x)[0, -n:].float(), dim=-1)

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
            out = []
            for _key, context, continuation in requests:
                whole = (context + continuation)[-(self.max_length + 1):]
                logp = self._logprobs(whole[:-1], len(continuation))
                target = torch.tensor(continuation, device=logp.device)
                score = float(logp.gather(1, target[:, None]).sum())
                out.append((score, bool((logp.argmax(-1) == target).all())))
            return out

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
            out = []
            for (string,) in [r.args for r in requests]:
                windows = map(utils.make_disjoint_window, utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1))
                scores = self._loglikelihood_tokens([(None, c, p) for c, p in windows])
                out.append(sum(s for s, _ in scores))
            return out

        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            out = []
            for context, gen_kwargs in [r.args for r in requests]:
                kw = dict(gen_kwargs)
                until = kw.pop("until", None) or []
                until = [until] if isinstance(until, str) else list(until)
                max_new = int(kw.pop("max_gen_toks", self.max_gen_toks))
                if kw.pop("do_sample", False) or kw.get("temperature", 0.0) not in (0, 0.0, None):
                    raise ConfigError("meshforge eval: generate_until runs greedy decoding only (a task asked "
                                      "for sampling: set do_sample false / temperature 0 in its YAML)")
                ids = greedy_until(self.model, self.tok_encode(context), max_new, self.max_length,
                                   {self.eot_token_id})
                text = self.tok_decode(ids)
                for stop in until:  # cut at the first stop string, as lm-eval's models do
                    text = text.split(stop)[0] if stop else text
                out.append(text)
            return out

    return MeshforgeLM()


def run_tasks(lm, tasks: list[str], include: list[str], limit: int | None = None, seed: int = 1234) -> dict:
    """{task: {metric: value}} of lm-eval's `simple_evaluate` on `lm` (any lm-eval LM) for local tasks."""
    _lm_eval()
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local task files only: never a download
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=list(include) or None, include_defaults=False)  # local tasks only
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ConfigError(f"meshforge eval: task {unknown[0]!r} is not in --include "
                          f"{', '.join(include) or '(none given)'}: give the folder of its task YAML (tasks are "
                          "read from local files only)")
    res = simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, limit=limit, log_samples=False,
                          bootstrap_iters=0, random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                          fewshot_random_seed=seed)
    return {t: {k.split(",")[0]: v for k, v in m.items() if "," in k and "_stderr" not in k}  # "acc,none" ...
            for t, m in res["results"].items()}
