"""`meshforge plan` against the bench's exact accounting, in the shared N=4 and N=2 launches.

Each configuration is built with `Trainer.build` and stepped by `bench.worker.measure` (the bench's own
measurement: storages behind params/grads/optimizer state after the step, collective bytes at the dispatcher);
the plan, computed without processes, must give the same bytes per rank and per collective kind.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from meshforge.planning.estimate import comm_per_step, model_params, rank_state
from meshforge.planning.layout import Layout
from meshforge.testing.group import Job
from meshforge.testing.parity import config

pytestmark = pytest.mark.dist

LORA = ["peft.rank=4", "peft.target_modules=[q_proj,v_proj,o_proj,gate_proj,down_proj]"]
MFSDP = {f"mfsdp_{m}": ["distributed.strategy=megatron_fsdp", f"distributed.data_parallel_sharding_strategy={m}"]
         for m in ("no_shard", "optim", "optim_grads", "optim_grads_params")}
N4 = {"ddp": ["distributed.strategy=ddp"], "fsdp2": ["distributed.strategy=fsdp2"], **MFSDP,
      "hsdp": ["distributed.strategy=fsdp2", "distributed.dp_replicate_size=2"],
      "fsdp2_tp2": ["distributed.strategy=fsdp2", "distributed.tp_size=2"],
      "pp2_cp2": ["distributed.strategy=fsdp2", "distributed.pp_size=2", "distributed.cp_size=2"],
      # issue 28's layouts: MoE stages with expert parallelism; tied embeddings under PP (the last stage's copy,
      # its gradient summed with the first stage's over the two end ranks; TP places the embedding's gradient as
      # its weight)
      "pp2_ep2": ["distributed.strategy=fsdp2", "model.preset=tiny_moe", "distributed.pp_size=2", "distributed.ep_size=2"],
      "pp2_tp2_tied": ["distributed.strategy=fsdp2", "distributed.pp_size=2", "distributed.tp_size=2",
                       "model.tie_embeddings=true"],
      # the fused loss on the last stage, vocabulary-parallel with sequence parallelism
      "pp2_tp2_sp_fused": ["distributed.strategy=fsdp2", "distributed.pp_size=2", "distributed.tp_size=2",
                           "distributed.sequence_parallel=true"],
      # bf16_params on pipeline stages sharded by fsdp2 (fp32 shards gathered in bf16)
      "bf16_params_pp2_fsdp2": ["distributed.strategy=fsdp2", "distributed.pp_size=2",
                                "training.precision=bf16_params"]}
# a Mixtral-shaped tiny MoE with attention and per-expert adapters (stacked by expert: they shard with EP)
MOE_LORA = ["model.preset=tiny_moe", "model.family=mixtral", "model.n_shared_experts=0", "peft.rank=4",
            "peft.target_modules=['*_proj']"]
DEEPSEEK = ["model.preset=tiny_deepseek"]
# (megatron_fsdp's four modes are checked at N=4; at N=2 with LoRA, whose frozen parameters get flat buffers of
# their own)
N2 = {"ddp": ["distributed.strategy=ddp"], "fsdp2": ["distributed.strategy=fsdp2"],
      "fsdp2_tp2": ["distributed.strategy=fsdp2", "distributed.tp_size=2"],
      "fsdp2_tp2_sp_full": ["distributed.strategy=fsdp2", "distributed.tp_size=2", "distributed.sequence_parallel=true",
                            "distributed.activation_checkpointing=full"],
      "tp2_full": ["distributed.strategy=fsdp2", "distributed.tp_size=2", "distributed.activation_checkpointing=full"],
      # without checkpointing each sub-layer gathers its kept sequence shard again in backward
      "fsdp2_tp2_sp": ["distributed.strategy=fsdp2", "distributed.tp_size=2", "distributed.sequence_parallel=true"],
      "fsdp2_tp2_sp_compiled": ["distributed.strategy=fsdp2", "distributed.tp_size=2",
                                "distributed.sequence_parallel=true", "training.compile=true",
                                "training.compile_backend=aot_eager"],
      "tp2_selective": ["distributed.strategy=fsdp2", "distributed.tp_size=2",
                        "distributed.activation_checkpointing=selective"],
      "tp2_sp_selective": ["distributed.strategy=fsdp2", "distributed.tp_size=2", "distributed.sequence_parallel=true",
                           "distributed.activation_checkpointing=selective"],
      "fsdp2_cp2": ["distributed.strategy=fsdp2", "distributed.cp_size=2"],
      "fsdp2_pp2": ["distributed.strategy=fsdp2", "distributed.pp_size=2"],
      "fsdp2_ep2": ["distributed.strategy=fsdp2", "model.preset=tiny_moe", "distributed.ep_size=2"],
      # LoRA: frozen base weights hold no gradient and no optimizer state; adapters (and norms, unfrozen) do
      "lora_ddp": ["distributed.strategy=ddp", *LORA],
      "lora_fsdp2": ["distributed.strategy=fsdp2", *LORA, "peft.freeze=[embeddings]"],
      "lora_tp2": ["distributed.strategy=fsdp2", "distributed.tp_size=2", *LORA],
      "lora_tp2_sp": ["distributed.strategy=fsdp2", "distributed.tp_size=2", "distributed.sequence_parallel=true",
                      "peft.rank=4", "peft.target_modules=[v_proj,o_proj,down_proj]"],
      "lora_tp2_sp_full": ["distributed.strategy=fsdp2", "distributed.tp_size=2", "distributed.sequence_parallel=true",
                           "distributed.activation_checkpointing=full", *LORA],
      "lora_mfsdp": ["distributed.strategy=megatron_fsdp", *LORA],
      "lora_mfsdp_optim": ["distributed.strategy=megatron_fsdp", "distributed.data_parallel_sharding_strategy=optim",
                           *LORA, "peft.freeze=[embeddings]"],
      "lora_ep2": ["distributed.strategy=fsdp2", *MOE_LORA, "distributed.ep_size=2"],
      # bf16_params under fsdp2: fp32 shards are the masters, parameters gathered in bf16, gradients reduced in fp32
      "bf16_params_fsdp2": ["distributed.strategy=fsdp2", "training.precision=bf16_params"],
      # tied embeddings in a V (both ends on rank 0: no gradient sum on the wire), an embedding-only first and a
      # head-only last stage; sequence parallelism with MoE (the sequence gathered around the experts)
      "pp2_tied_v_ends": ["distributed.strategy=fsdp2", "distributed.pp_size=2", "model.tie_embeddings=true",
                          "distributed.pipeline.pp_schedule=v_schedule", "distributed.pipeline.first_stage_layers=0",
                          "distributed.pipeline.last_stage_layers=0"],
      "tp2_sp_moe": ["distributed.strategy=fsdp2", "model.preset=tiny_moe", "distributed.tp_size=2",
                     "distributed.sequence_parallel=true"],
      # DeepSeek-V3: a dense and an MoE block (two block shapes); latent attention under TP (column-wise inputs of
      # rank q_lora / kv_lora, the shared rope key's gradient); EP with auxiliary-loss-free balancing (its loads)
      "ds_fsdp2": ["distributed.strategy=fsdp2", *DEEPSEEK],
      "ds_tp2": ["distributed.strategy=fsdp2", *DEEPSEEK, "distributed.tp_size=2"],
      "ds_ep2_balanced": ["distributed.strategy=fsdp2", *DEEPSEEK, "model.router_bias_update_rate=0.01",
                          "distributed.ep_size=2"],
      # bf16 replicas and fp32 main gradients averaged by ddp itself (no reducer buckets); megatron_fsdp's bf16
      # compute buffers beside its fp32 main ones; pipeline stages with the fp32 masters in their optimizer
      "bf16_params_ddp": ["distributed.strategy=ddp", "training.precision=bf16_params"],
      "bf16_params_mfsdp": ["distributed.strategy=megatron_fsdp", "training.precision=bf16_params"],
      "bf16_params_pp2": ["distributed.strategy=fsdp2", "distributed.pp_size=2", "training.precision=bf16_params"],
      # the plain vocabulary-parallel loss (the others above take the fused one where they can)
      "fsdp2_tp2_plain": ["distributed.strategy=fsdp2", "distributed.tp_size=2", "training.fused_loss=false"],
      # reshard_after_forward: the root is gathered again in backward with the plain loss, kept with the fused one
      "fsdp2_reshard_fused": ["distributed.strategy=fsdp2", "distributed.reshard_after_forward=true"],
      "fsdp2_reshard_plain": ["distributed.strategy=fsdp2", "distributed.reshard_after_forward=true",
                              "training.fused_loss=false"],
      # biases under TP (the row-wise projection's stays whole), GPT-OSS (sinks split with the heads, experts with
      # biases) and Gemma 3 (four norms a block, QK-norm gradients summed over tp)
      "bias_tp2": ["distributed.strategy=fsdp2", "distributed.tp_size=2", "model.attention_bias=true"],
      "gpt_oss_fsdp2_ep2": ["distributed.strategy=fsdp2", "model.preset=tiny_gpt_oss", "distributed.ep_size=2"],
      "gpt_oss_tp2": ["distributed.strategy=fsdp2", "model.preset=tiny_gpt_oss", "distributed.tp_size=2"],
      # (Gemma 3's head is tied: the planner counted its gradient whole and missed the head's collectives)
      "gemma3_fsdp2_tp2_sp": ["distributed.strategy=fsdp2", "model.preset=tiny_gemma3", "distributed.tp_size=2",
                              "distributed.sequence_parallel=true"],
      "tied_tp2": ["distributed.strategy=fsdp2", "distributed.tp_size=2", "model.tie_embeddings=true"],
      "gemma3_fsdp2_cp2": ["distributed.strategy=fsdp2", "model.preset=tiny_gemma3", "distributed.cp_size=2"]}
STEPS = 3


def plan_job(spec: dict, info) -> dict:
    """Measure each configuration with the bench's worker: {name: {per_rank state bytes, by_op bytes}}."""
    from meshforge.bench.worker import measure

    import torch

    out = {}
    for name, overrides in spec["configs"].items():
        torch._dynamo.reset()  # the compiled configs: a fresh cache, not a recompile limit hit by earlier ones
        r = measure(config(overrides, steps=STEPS, world_size=info.world_size), info, 1, 1)
        out[name] = {"state": [p["state_bytes"] for p in r["per_rank"]], "by_op": r["comm"]["by_op"]}
    return out


class _Saved:
    """Saved-tensor hooks that record the bytes of every storage autograd keeps (parameter storages, also FSDP's
    gathered ones, excluded): `total` and the `largest` one."""

    def __init__(self, model):
        import torch

        self.model, self.seen, self.torch = model, {}, torch

    @staticmethod
    def ptr(t):
        from torch.distributed.tensor import DTensor

        try:
            return (t.to_local() if isinstance(t, DTensor) else t).untyped_storage().data_ptr()
        except RuntimeError:  # a freed (resharded) storage
            return None

    def pack(self, t):
        from torch import nn
        from torch.distributed.tensor import DTensor

        if self.ptr(t) not in {self.ptr(p) for p in self.model.parameters()} and not isinstance(t, nn.Parameter):
            self.seen[self.ptr(t)] = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage().nbytes()
        return t

    def hooks(self):
        self.seen.clear()
        return self.torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    def result(self) -> dict:
        return {"total": sum(self.seen.values()), "largest": max(self.seen.values(), default=0)}


def saved_job(spec: dict, info) -> dict:
    """{name: {total, largest} bytes autograd saves for one micro batch's forward and loss on rank 0} on the real
    TP/SP/CP model (`_Saved`)."""
    import torch

    from meshforge.models.loss import lm_loss
    from meshforge.training.trainer import Trainer

    out = {}
    for name, overrides in spec.items():
        torch._dynamo.reset()
        cfg = config(overrides, steps=STEPS, world_size=info.world_size)
        pm = Trainer.build(cfg, info).pm
        saved = _Saved(pm.model)
        b, s = cfg.training.micro_batch_size, cfg.training.seq_len
        g = torch.Generator().manual_seed(0)
        x, y = torch.randint(0, 256, (b, s), generator=g), torch.randint(0, 256, (b, s), generator=g)
        positions = None
        if pm.batch_transform is not None:
            x, y, positions = pm.batch_transform(x, y)
        for _ in range(2 if cfg.training.compile is True else 1):  # compiled: the first pass compiles
            with saved.hooks():
                o = pm.model(x) if positions is None else pm.model(x, positions)
                with pm.loss_context():
                    ce = lm_loss(o, y).mean
            with pm.loss_context():
                ce.backward()  # every rank runs the same collectives
        out[name] = saved.result()
    return out


def last_stage_saved_job(spec: dict, info) -> dict:
    """{name: {total, largest}} saved by the last pipeline stage (pp rank 1 of PP2) for one micro batch: the
    stage's forward from its input hidden states, and the loss on what the stage hands it."""
    import torch
    import torch.distributed as dist

    from meshforge.models.loss import lm_loss
    from meshforge.training.trainer import Trainer

    out = {}
    for name, overrides in spec.items():
        cfg = config(overrides, steps=STEPS, world_size=info.world_size)
        pm = Trainer.build(cfg, info).pm
        mine = None
        if pm.has_last:
            stage = pm.parts[-1]
            saved = _Saved(stage)
            b, s, dim = pm.plan.microbatch_size, cfg.training.seq_len, model_params(cfg)[1].dim
            g = torch.Generator().manual_seed(0)
            h = torch.randn(b, s, dim, generator=g, requires_grad=True)
            y = torch.randint(0, 256, (b, s), generator=g)
            with saved.hooks():  # (the sum: a mean would also keep the int64 count, 8 bytes, for its backward)
                ce = lm_loss(pm._head.rejoin(stage(h)), y).ce_sum
            ce.backward()
            mine = saved.result()
        everyone: list = [None] * info.world_size
        dist.all_gather_object(everyone, mine)
        out[name] = next(r for r in everyone if r is not None)
    return out


# the fused loss (the default where it can run, so "tp2" and "tp2_sp_small" have it): under TP each rank keeps
# the head's input (gathered under SP) and one fp32 log-sum-exp a token, never its [tokens, vocab/tp] logits;
# a vocabulary of 2048 makes those logits the largest tensor a plain loss keeps
VOCAB = ["model.vocab_size=2048"]
ACTS = {"tp2": ["distributed.tp_size=2"],
        "tp2_fused_vocab2048": ["distributed.tp_size=2", *VOCAB],
        "tp2_plain_vocab2048": ["distributed.tp_size=2", "training.fused_loss=false", *VOCAB],
        "tp2_sp_fused_vocab2048": ["distributed.tp_size=2", "distributed.sequence_parallel=true", *VOCAB],
        "tp2_full": ["distributed.tp_size=2", "distributed.activation_checkpointing=full"],
        "tp2_sp_small": ["distributed.tp_size=2", "distributed.sequence_parallel=true", "model.preset=small"],
        # compiled blocks keep the gathered input whole (the shard-keeping hooks would break the graph)
        "tp2_sp_small_compiled": ["distributed.tp_size=2", "distributed.sequence_parallel=true", "model.preset=small",
                                  "training.compile=true", "training.compile_backend=aot_eager"],
        "cp2": ["distributed.cp_size=2"],
        "cp2_full": ["distributed.cp_size=2", "distributed.activation_checkpointing=full"],
        "lora_tp2_sp": ["distributed.tp_size=2", "distributed.sequence_parallel=true", *LORA],
        "lora_cp2": ["distributed.cp_size=2", *LORA],
        "bf16_params_cp2": ["distributed.cp_size=2", "training.precision=bf16_params"],
        # MoE: the routed experts on the whole sequence on every tp rank
        "tp2_sp_moe": ["distributed.tp_size=2", "distributed.sequence_parallel=true", "model.preset=tiny_moe"],
        "cp2_moe": ["distributed.cp_size=2", "model.preset=tiny_moe"]}
# the last pipeline stage (one block, the final norm, the head) of PP2, with the fused loss and with the plain one
PP_ACTS = {f"pp2_last_stage_{k}": ["distributed.pp_size=2", "distributed.pipeline.pp_microbatch_size=2",
                                   f"training.fused_loss={v}", *VOCAB] for k, v in (("fused", "true"),
                                                                                    ("plain", "false"))}
HERE = f"{Path(__file__).resolve()}"
GROUP_JOBS = [Job("plan accuracy n4", f"{HERE}:plan_job", {"configs": N4}, 4),
              Job("plan accuracy n2", f"{HERE}:plan_job", {"configs": N2}, 2),
              Job("plan activations n2", f"{HERE}:saved_job", ACTS, 2),
              Job("plan activations pp n2", f"{HERE}:last_stage_saved_job", PP_ACTS, 2)]


def _kind(op: str) -> str:
    for key, kind in (("allgather", "all_gather"), ("all_gather", "all_gather"), ("reduce_scatter", "reduce_scatter"),
                      ("allreduce", "all_reduce"), ("all_reduce", "all_reduce"), ("alltoall", "all_to_all"),
                      ("all_to_all", "all_to_all"), ("send", "send_recv"), ("recv", "send_recv"),
                      ("broadcast", "broadcast")):
        if key in op:
            return kind
    return op


def _compare(measured: dict, configs: dict, n: int):
    for name, m in measured.items():
        cfg = config(configs[name], steps=STEPS, world_size=n)
        d = cfg.distributed
        layout = Layout.from_sizes(n, tp=d.tp_size, pp=d.pp_size, cp=d.cp_size, ep=d.ep_size,
                                   dp_replicate=d.dp_replicate_size)
        params, args = model_params(cfg)
        for rank, bench in enumerate(m["state"]):
            got = rank_state(params, cfg, layout, rank)
            assert (got.params, got.grads, got.optimizer) == (bench["params"], bench["grads"], bench["optimizer"]), \
                (name, rank)
        bench_kinds: dict = {}
        for op, b in m["by_op"].items():
            bench_kinds[_kind(op)] = bench_kinds.get(_kind(op), 0) + b
        plan_kinds: dict = {}
        for (_axis, kind), b in comm_per_step(params, args, cfg, layout).items():
            plan_kinds[kind] = plan_kinds.get(kind, 0) + b
        yield name, bench_kinds, plan_kinds


ROUTED = ("fsdp2_ep2", "lora_ep2", "pp2_ep2", "ds_ep2_balanced", "gpt_oss_fsdp2_ep2")  # what a rank receives from
# the all-to-all depends on the routing


def _routed_within(name: str, bench: dict, plan: dict) -> None:
    """The plan counts the balanced top_k copies per token (within 5% here; DeepSeek's group-limited routing of
    random weights sends rank 0's experts 35% of the copies, not 50%: 15% under the plan; GPT-OSS's router, biased,
    sends rank 0 16.3% more, measured); everything else exact."""
    if name in ROUTED:
        a2a = bench.pop("all_to_all")
        assert abs(a2a - plan.pop("all_to_all")) / a2a < (0.2 if name.startswith(("ds_", "gpt_oss")) else 0.05), name


def test_state_and_comm_n4(group):
    for name, bench, plan in _compare(group("plan accuracy n4"), N4, 4):
        _routed_within(name, bench, plan)
        assert bench == plan, (name, bench, plan)


def test_state_and_comm_n2(group):
    for name, bench, plan in _compare(group("plan accuracy n2"), N2, 2):
        _routed_within(name, bench, plan)
        assert bench == plan, (name, bench, plan)


def _logits_bytes(cfg, tp: int, micro_batch: int) -> int:
    """The fp32 logits of one micro batch on one tp rank: what the plain loss keeps and the fused one never does."""
    return micro_batch * cfg.training.seq_len * model_params(cfg)[1].vocab_size // tp * 4


def test_activations_tp_sp_cp_n2(group):
    from meshforge.planning.estimate import activation_bytes

    for name, got in group("plan activations n2").items():
        measured = got["total"]
        cfg = config(ACTS[name], steps=STEPS, world_size=2)
        d = cfg.distributed
        _, args = model_params(cfg)
        plan = activation_bytes(args, cfg, Layout.from_sizes(2, tp=d.tp_size, cp=d.cp_size), args.n_layers,
                                True, True)["total"]
        print(f"\n{name}: plan {plan} measured {measured} ({100 * (plan - measured) / measured:+.2f}%)")
        # within 1% (the issue asks 10%): a projection keeping the gathered sequence under sequence parallelism
        # (instead of its shard) would be 12% over the plan for tp2_sp_small
        assert abs(plan - measured) <= 0.01 * measured, (name, plan, measured)
        if name.endswith("vocab2048"):  # the fused loss keeps nothing the size of the logits; the plain one does
            logits = _logits_bytes(cfg, d.tp_size, cfg.training.micro_batch_size)
            assert (got["largest"] < logits) == ("fused" in name), (name, got, logits)


def test_last_pipeline_stage_activations_n2(group):
    """The last stage's saved bytes equal the plan's for its blocks and head, and with the fused loss nothing of
    the logits' size is kept (the plain loss keeps the fp32 log-softmax)."""
    from meshforge.planning.estimate import activation_bytes

    got = group("plan activations pp n2")
    for name, m in got.items():
        cfg = config(PP_ACTS[name], steps=STEPS, world_size=2)
        _, args = model_params(cfg)
        plan = activation_bytes(args, cfg, Layout.from_sizes(2, pp=2), args.n_layers // 2, False, True, 2)["total"]
        print(f"\n{name}: plan {plan} measured {m['total']} ({100 * (plan - m['total']) / m['total']:+.2f}%)")
        assert plan == m["total"], (name, plan, m)
        assert (m["largest"] < _logits_bytes(cfg, 1, 2)) == ("fused" in name), (name, m)
