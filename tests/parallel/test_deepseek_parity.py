"""DeepSeek-V3 (`tiny_deepseek`: one dense block then one MoE block of 8 experts, compressed q and kv, groups of 2
experts, top-2 of the best 2 groups) trains under every layout its family allows with the single-process losses.

fp32, the parity harness's batch (8 x 32 tokens; packed SFT rows of 128 where marked), 6 steps, against the same
overrides in one process. Bounds as tests/parallel/test_expert_parallel.py's (routing is discrete: losses 1e-5
relative, weights and grad norms 1e-3); the auxiliary-loss-free selection bias (`router_bias_update_rate`, 0.01 a
step) must equal the single-process one exactly: it moves by whole steps from integer loads summed over the ranks.

N=2: fsdp2 on packed sequences; TP2 (heads split, the shared rope key's gradient summed); EP2 with balancing; CP2
on packed sequences (the expanded K and V, of different widths, gathered); PP2 (the MoE block on the second stage)
and TP2 + SP (the MoE block gathers the sequence around its experts), both balancing; LoRA on the latent
attention's projections and the routed experts with EP2, and on the attention with TP2; balancing under
megatron_fsdp (with activation checkpointing) and ddp. N=4: fsdp2 x EP2 x TP2 and EP4, both balancing.
"""

from pathlib import Path

import pytest

from meshforge.testing.group import Job
from meshforge.testing.parity import compare, results_of

pytestmark = pytest.mark.dist

STEPS, LOSS_RTOL, WEIGHT_ATOL, GRAD_NORM_RTOL = 6, 1e-5, 1e-3, 1e-3
DS = ["model.preset=tiny_deepseek"]
BAL = [*DS, "model.router_bias_update_rate=0.01"]
DATA = Path(__file__).resolve().parents[2] / "examples" / "data" / "prompt_completion_tiny.jsonl"
PACKED = [*DS, "data.source=dataset", f"data.paths=[{DATA}]", "data.format=prompt_completion", "data.packing=true",
          "training.seq_len=128"]
LORA_MLA = ["peft.rank=4", "peft.target_modules=[q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj]",
            "optimizer.lr=1e-3"]
LORA_EXPERTS = ["peft.rank=4", "peft.target_modules=[q_b_proj,kv_b_proj,o_proj,experts.gate_up_proj,"
                "experts.down_proj]", "optimizer.lr=1e-3"]

N2 = {
    "fsdp2_packed": [*PACKED, "distributed.strategy=fsdp2"],
    "tp2": [*BAL, "distributed.tp_size=2"],
    "ep2_balanced": [*BAL, "distributed.ep_size=2"],
    "cp2_packed": [*PACKED, "distributed.cp_size=2"],
    "pp2_balanced": [*BAL, "distributed.pp_size=2", "distributed.pipeline.pp_microbatch_size=2"],
    "lora_ep2": [*DS, *LORA_EXPERTS, "distributed.ep_size=2"],
    "lora_tp2": [*DS, *LORA_MLA, "distributed.tp_size=2"],
    "tp2_sp_balanced": [*BAL, "distributed.tp_size=2", "distributed.sequence_parallel=true"],
    # the bias, a buffer, beside megatron_fsdp's flat buffers (and recomputed blocks); under DDP, which broadcasts
    # buffers from rank 0 (the loads are not buffers: each rank's own until the step's all-reduce)
    "megatron_fsdp_ac_balanced": [*BAL, "distributed.strategy=megatron_fsdp",
                                  "distributed.activation_checkpointing=full"],
    "ddp_balanced": [*BAL, "distributed.strategy=ddp"],
}
N4 = {
    "fsdp2_ep2_tp2_balanced": [*BAL, "distributed.ep_size=2", "distributed.tp_size=2"],
    "ep4_balanced": [*BAL, "distributed.ep_size=4"],
    # DeepSeek-V3's natural layout (issue 30): pipeline x expert parallelism, the dense first block on stage 0
    "pp2_ep2_balanced": [*BAL, "distributed.pp_size=2", "distributed.ep_size=2",
                         "distributed.pipeline.pp_microbatch_size=2"],
}
# issue 30's natural layouts with all three axes, in one launch of 8 processes: DeepSeek-V3's pp x ep x tp
# (examples/moe_pp_ep_tp.yaml's layout) and, sharing the launch, Gemma 3's fsdp2 x tp x cp
N8 = {"pp2_ep2_tp2_sp_balanced": [*BAL, "distributed.pp_size=2", "distributed.ep_size=2", "distributed.tp_size=2",
                                  "distributed.sequence_parallel=true", "distributed.pipeline.pp_microbatch_size=2"],
      "gemma3_fsdp2_tp2_sp_cp2": ["model.preset=tiny_gemma3", "distributed.strategy=fsdp2", "distributed.tp_size=2",
                                  "distributed.sequence_parallel=true", "distributed.cp_size=2"]}
GROUP_JOBS = [Job(f"deepseek parity n{n}", "meshforge.testing.parity:configs_job", {"configs": configs, "steps": STEPS},
                  n) for n, configs in ((2, N2), (4, N4), (8, N8))]


@pytest.mark.parametrize("nproc,configs", [(2, N2), (4, N4), (8, N8)], ids=["N2", "N4", "N8"])
def test_parity_with_one_process(reference, group, nproc, configs):
    results = results_of(group(f"deepseek parity n{nproc}"))
    failures = []
    for name, overrides in configs.items():
        ref = reference([o for o in overrides if not o.startswith("distributed.")], steps=STEPS)
        try:
            compare(ref, results[name], name, LOSS_RTOL, WEIGHT_ATOL, GRAD_NORM_RTOL)
            bias = [k for k in ref.weights if k.endswith("expert_bias")]
            for k in bias:
                assert results[name].weights[k].tolist() == ref.weights[k].tolist(), (name, k)
            if "balanced" in name:  # the bias moved: the option was on and its update is the global one
                assert bias and any(ref.weights[k].abs().sum() > 0 for k in bias), name
        except AssertionError as err:
            failures.append(str(err))
    assert not failures, "\n".join(failures)
