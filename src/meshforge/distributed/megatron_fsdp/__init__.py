"""`strategy: megatron_fsdp`: Megatron-FSDP in meshforge's own code (CPU/gloo and GPU/NCCL).

Per FSDP unit (each transformer block by default; `distributed.fsdp_unit_classes` names module classes instead;
everything outside the units is one more unit) the parameters live in one flat buffer padded to a multiple of
the dp_cp size, and the gradients in another (`buffers.py`); the model's parameters become views into them.
`strategy.py` drives gathering, reduction, the optimizer pieces and the fsdp_dtensor state dicts; `comm.py`
wraps and counts the collectives.

Options (`distributed.*`, defaults in brackets):
- `data_parallel_sharding_strategy` [optim_grads_params] (or `zero_dp_strategy` 0-3): no_shard (DDP-like,
  all-reduce), optim (ZeRO-1: fp32 main params and AdamW state for the local shard; grads all-reduced; updated
  params all-gathered), optim_grads (ZeRO-2: grads reduce-scattered, only the shard kept), optim_grads_params
  (ZeRO-3: params sharded at rest, all-gathered before each unit's forward and backward, next unit prefetched).
- `average_in_collective` [false]: divide by N inside the collective (ReduceOp.AVG) or after a SUM.
- `grad_reduce_in_fp32` [true]: reduce gradients in fp32 even when compute params are bf16.
- `overlap_grad_reduce`, `overlap_param_gather` [true on CUDA, false on CPU]: issue the collectives
  asynchronously (NCCL runs them on its own streams, overlapping compute) and wait at first use.
- `keep_fp8_transpose_cache`: accepted for Bridge compatibility and inert (a config warning says so): it caches
  fp8 weights' transposes, and meshforge keeps no fp8 weights (`training.fp8` casts bf16/fp32 weights per matmul).
Compute dtype: bf16 on CUDA, fp32 on CPU (`MegatronFSDPStrategy(..., compute_dtype=)` to choose).

Composes with TP (DTensor parameters: the buffers pack their local tensors) and CP (sharding over dp_cp).
Checkpoint API (fsdp_dtensor, used by the checkpoint parts in `checkpoint/parts.py`): `model_state_dict`,
`load_model_state_dict`, `optimizer_state_dict`, `load_optimizer_state_dict` (per-parameter DTensors, Shard(0)
on the dp_cp mesh, the layout FSDP2 uses, so DCP reshards and interchanges with fsdp2/ddp). Accounting for benchmarks:
`comm_bytes`, `comm_calls`, `reset_comm()`, `memory_report(optimizer)` (see `strategy.py`).
"""

from meshforge.distributed.megatron_fsdp.strategy import MegatronFSDPStrategy

__all__ = ["MegatronFSDPStrategy"]
