"""`strategy: megatron_fsdp`: Megatron-FSDP in meshforge's own code (CPU and GPU).

Per FSDP unit (each transformer block by default, `distributed.fsdp_unit_classes` to choose module classes;
everything else is one more unit) the parameters live in one flat, padded buffer and the gradients in another
(`buffers.py`); `strategy.py` drives gathering, reduction, the optimizer pieces and the fsdp_dtensor state dicts;
`comm.py` counts the bytes each collective is handed. Sharding strategies: no_shard / optim / optim_grads /
optim_grads_params (zero_dp_strategy 0-3).
"""

from meshforge.distributed.megatron_fsdp.strategy import MegatronFSDPStrategy

__all__ = ["MegatronFSDPStrategy"]
