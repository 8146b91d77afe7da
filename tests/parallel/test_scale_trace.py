"""The plan against the scale trace (meshforge.scale): one real training step of rank 0 (every layout) and the
last rank (the layouts in LAST_RANK) of a 4-rank job (and of an 8-rank one for MATRIX8), each in one process on fake tensors, for a matrix of layouts at
shapes wide enough to be like real ones (the trace's cost is the number of ops, not their size). Asked of the
plan (issue 27): state bytes and collective bytes per (mesh axis, kind) exact, peak memory within 3%.

Two processes (one per traced rank of each world: `meshforge.scale.worker`), every configuration inside them,
run side by side; no gloo launch. The example configs' full shapes are `benchmarks/scale_trace.py` (docs/scale.md).
"""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import pytest

from meshforge.config import load_config
from meshforge.scale.compare import PEAK_BOUND, compare
from meshforge.scale.trace import RankTrace, layout_of
from meshforge.scale.worker import trace_jobs

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[2]
WORLD = 4
PATH = str(ROOT / "examples" / "llama3_8b.yaml")
# Llama 3 8B's widths (vocab, dim, heads, ffn) with two blocks and 2,048-token sequences: what dominates a real
# rank's memory dominates here too, and a step is a few hundred ops. Measured beside the matrix (docs/scale.md):
# FP8 with the other strategies and layouts, HSDP with FP8 (-0.1%), gpipe's last rank (+2.06%).
SHAPE = ["model.n_layers=2", "training.seq_len=2048", "training.global_batch_size=4", "training.micro_batch_size=1",
         "training.compile=false"]
MATRIX = {
    "fsdp2_selective": [],
    "fsdp2_none": ["distributed.activation_checkpointing=false"],
    "fsdp2_full": ["distributed.activation_checkpointing=full"],
    # four micro batches: FSDP2 accumulates unsharded fp32 gradients (deferred sync), or reduces each one
    "fsdp2_accum": ["training.global_batch_size=16"],
    "fsdp2_accum_nodefer": ["training.global_batch_size=16", "distributed.defer_fsdp_grad_sync=false"],
    # micro batches folded: the same step traced whole (fold=False below) must give the same numbers
    "fsdp2_accum_unfolded": ["training.global_batch_size=16"],
    "ddp": ["distributed.strategy=ddp", "distributed.defer_fsdp_grad_sync=null"],
    # the GPU's choices: reductions overlapped, every unit's full gradient buffer alive to the embedding's backward
    "megatron_fsdp": ["distributed.strategy=megatron_fsdp", "distributed.defer_fsdp_grad_sync=null"],
    # the CPU's choice: each unit's full gradient buffer freed once reduced, the root's alive in every block's backward
    "megatron_fsdp_sync": ["distributed.strategy=megatron_fsdp", "distributed.defer_fsdp_grad_sync=null",
                           "distributed.overlap_grad_reduce=false"],
    # the modes that keep parameters whole gather nothing: ZeRO-1 (gradients whole), ZeRO-2 (overlapped reductions)
    "megatron_fsdp_optim": ["distributed.strategy=megatron_fsdp", "distributed.defer_fsdp_grad_sync=null",
                            "distributed.data_parallel_sharding_strategy=optim"],
    "megatron_fsdp_optim_grads": ["distributed.strategy=megatron_fsdp", "distributed.defer_fsdp_grad_sync=null",
                                  "distributed.data_parallel_sharding_strategy=optim_grads"],
    # ZeRO-2: parameters whole, the root's and the block's full gradient buffers alive in the block's backward
    "megatron_fsdp_optim_grads_sync": ["distributed.strategy=megatron_fsdp", "distributed.defer_fsdp_grad_sync=null",
                                       "distributed.overlap_grad_reduce=false",
                                       "distributed.data_parallel_sharding_strategy=optim_grads"],
    # HSDP 2 x 2: the root's reduce-scatter output (1/2 of it, fp32) beside its input and its last gradient
    "hsdp": ["distributed.dp_replicate_size=2"],
    # reduced after every micro batch: each unit's all-reduce buffer, kept to the end of backward, beside its gradient
    "hsdp_accum_nodefer": ["distributed.dp_replicate_size=2", "training.global_batch_size=16",
                           "distributed.defer_fsdp_grad_sync=false"],
    "tp2": ["distributed.tp_size=2"],
    "tp2_sp": ["distributed.tp_size=2", "distributed.sequence_parallel=true"],
    "cp2": ["distributed.cp_size=2"],
    # interleaved 1F1B, two stages a rank: FSDP2 keeps the stages gathered and their gradients unsharded
    "pp2_interleaved": ["distributed.pp_size=2", "training.global_batch_size=8", "model.n_layers=4",
                        "distributed.pipeline.pp_schedule=interleaved_1f1b",
                        "distributed.pipeline.virtual_stages_per_rank=2"],
    # each micro batch re-gathers the stages; the last stage's root stays gathered (the fused loss reads its head)
    "pp2_interleaved_reshard": ["distributed.pp_size=2", "training.global_batch_size=8", "model.n_layers=4",
                                "distributed.pipeline.pp_schedule=interleaved_1f1b",
                                "distributed.pipeline.virtual_stages_per_rank=2", "distributed.reshard_after_forward=true"],
    # a single-stage schedule: its first rank's peak is the schedule's gradient reduction (REDUCE_GRAD)
    "pp2_1f1b": ["distributed.pp_size=2", "training.global_batch_size=8"],
    # no data parallelism: the stages run autocast over fp32 parameters, the residual stream and what TP collects
    # of it in fp32, the embedding's gradient fp32 and whole
    "tp2_pp2": ["distributed.tp_size=2", "distributed.pp_size=2"],
    "tp2_sp_pp2": ["distributed.tp_size=2", "distributed.pp_size=2", "distributed.sequence_parallel=true"],
    "ep2_moe": ["model.preset=qwen3_30b_a3b", "model.n_layers=2", "distributed.ep_size=2",
                "distributed.activation_checkpointing=full"],
    # each token's routed copies kept for backward (QK-norm's inputs too); under selective checkpointing the routed
    # experts run outside its cache (recomputed)
    "ep2_moe_none": ["model.preset=qwen3_30b_a3b", "model.n_layers=2", "distributed.ep_size=2",
                     "distributed.activation_checkpointing=false"],
    "ep2_moe_selective": ["model.preset=qwen3_30b_a3b", "model.n_layers=2", "distributed.ep_size=2",
                          "distributed.activation_checkpointing=selective"],
    # MoE stages with expert parallelism: stage 0's output is probed with its embedding alone (no MoE layer), the
    # last stage returns (logits, aux loss); rank 0's peak is the schedule's gradient reduction (REDUCE_GRAD)
    "pp2_ep2_moe": ["model.preset=qwen3_30b_a3b", "model.n_layers=2", "distributed.ep_size=2", "distributed.pp_size=2",
                    "distributed.activation_checkpointing=full"],
    "lora": ["peft.rank=16", "peft.target_modules=[q_proj,v_proj]"],
    "bf16_params": ["training.precision=bf16_params"],
    "compile": ["training.compile=true"],
    # FP8 (torchao float8 linears): fsdp2 gathers the float8 weights (1 byte an element) after all-reducing each
    # one's amax; rowwise scales gather in bf16; under TP every cast of a tp-sharded tensor all-reduces its amax
    "fp8": ["training.fp8.enabled=true"],
    "fp8_rowwise": ["training.fp8.enabled=true", "training.fp8.recipe=rowwise"],
    "fp8_tp2": ["training.fp8.enabled=true", "distributed.tp_size=2"],
    # LoRA's adapted linears and factors stay in high precision (torchao used to drop the adapters)
    "fp8_lora": ["training.fp8.enabled=true", "peft.rank=16", "peft.target_modules=[q_proj,v_proj]"],
}
UNFOLDED = {"fsdp2_accum_unfolded"}
# traced at 8 ranks (rank 0 and 7), after the 4-rank jobs in the same two processes: interleaved 1F1B with four
# micro batches a rank (dp 4), with and without Llama 3 405B's empty end stages
WORLD8 = 8
MATRIX8 = {
    "pp2_interleaved_w8": ["distributed.pp_size=2", "training.global_batch_size=16", "model.n_layers=4",
                           "distributed.pipeline.pp_schedule=interleaved_1f1b",
                           "distributed.pipeline.virtual_stages_per_rank=2"],
    "pp2_interleaved_ends_w8": ["distributed.pp_size=2", "training.global_batch_size=16", "model.n_layers=4",
                                "distributed.pipeline.pp_schedule=interleaved_1f1b",
                                "distributed.pipeline.virtual_stages_per_rank=2",
                                "distributed.pipeline.first_stage_layers=0", "distributed.pipeline.last_stage_layers=0"],
}
# state and collectives exact, peak not yet within the bound (a gap the plan has to close, measured here): none
PEAK_GAPS: set[str] = set()


# the last rank is traced where it holds something rank 0 does not (pipeline stages), beside a few layouts whose
# ranks are alike (their numbers are rank 0's: a check of that), and the folding check's whole step (the suite's
# time: every trace costs seconds of CPU the shared launches run beside)
LAST_RANK = {n for n, extra in MATRIX.items() if any(o.startswith("distributed.pp_size") for o in extra)} | {
    "fsdp2_selective", "hsdp", "megatron_fsdp", "ep2_moe", "fsdp2_accum", "fsdp2_accum_unfolded"}


def _traces() -> dict[int, list[dict]]:
    ranks = (0, WORLD - 1)

    def jobs_of(r: int) -> list[dict]:  # the 8-rank jobs: rank 0 of 8 after rank 0 of 4, rank 7 after rank 3
        mine = [n for n in MATRIX if (n in LAST_RANK if r else n not in UNFOLDED)]
        return [{"name": name, "path": PATH, "overrides": SHAPE + MATRIX[name], "fold": name not in UNFOLDED}
                for name in mine] + [{"name": name, "path": PATH, "overrides": SHAPE + extra, "world_size": WORLD8,
                                      "rank": 0 if r == 0 else WORLD8 - 1} for name, extra in MATRIX8.items()]

    with concurrent.futures.ThreadPoolExecutor(len(ranks)) as pool:
        futures = {r: pool.submit(trace_jobs, WORLD, r, jobs_of(r), 900) for r in ranks}
        return {r: f.result() for r, f in futures.items()}


@pytest.fixture(scope="module")
def traces() -> dict[int, list[dict]]:
    return _traces()


def _comparisons(traces):
    for rank, results in traces.items():
        for res in results:
            assert "error" not in res, (rank, res["name"], res.get("error"))
            world = res["world_size"]
            cfg = load_config(PATH, SHAPE + (MATRIX | MATRIX8)[res["name"]], world_size=world)
            trace = RankTrace.from_dict(res, layout_of(cfg, world))
            yield res["name"], trace, compare(cfg, trace)


def test_state_and_collectives_exact(traces):
    for name, _trace, c in _comparisons(traces):
        assert c.state_exact, (name, c.rank, c.state_plan, c.state_trace)
        assert c.comm_exact, (name, c.rank, c.problems())


def test_peak_within_bound(traces):
    for name, trace, c in _comparisons(traces):
        print(f"{name} rank {c.rank}: plan {c.peak_plan:,} trace {c.peak_trace:,} ({100 * c.peak_error:+.2f}%) "
              f"[{'; '.join(trace.notes)}]")
        assert name in PEAK_GAPS or abs(c.peak_error) <= PEAK_BOUND, (name, c.rank, c.peak_plan, c.peak_trace,
                                                                      trace.notes)


def test_folding_is_exact(traces):
    """Folding micro batches 1 .. n-2 into one (counted n-2 times) changes nothing the trace reports."""
    for rank, results in traces.items():
        by = {r["name"]: r for r in results}
        if "fsdp2_accum_unfolded" not in by:
            continue
        folded, whole = by["fsdp2_accum"], by["fsdp2_accum_unfolded"]
        assert folded["microbatches_run"] == 3 and whole["microbatches_run"] == whole["microbatches"] == 4
        assert folded["peak"] == whole["peak"], rank
        assert folded["comm"] == whole["comm"], rank
        assert folded["state"] == whole["state"], rank
