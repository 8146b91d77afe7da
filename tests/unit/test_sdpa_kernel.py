"""SDPA takes a fused kernel at the issue's shape (bench/sdpa.py).

On CPU: the exact call the model's attention makes at the Llama-3.2-1B shape (32 q / 8 kv heads, head dim 64,
seq 4096, micro batch 4, bf16 parameters), recorded on the meta device, meets every condition of the flash
backend (no dense mask, is_causal, bf16, head dim, last dim contiguous, enable_gqa for the kv heads); and the
profiler-based report the GPU script prints names the kernel that really ran (CPU: flash attention for CPU).
"""

import torch

from meshforge.bench.sdpa import flash_ineligible, sdpa_calls, sdpa_report
from meshforge.config.schema import ModelConfig

ONE_B = ModelConfig(preset="llama3_2_1b")


def test_the_1b_training_call_is_flash_eligible():
    (call,) = sdpa_calls(ONE_B, 4096, 4)  # one block, one attention call
    assert tuple(call["q"].shape) == (4, 32, 4096, 64) and tuple(call["k"].shape) == (4, 8, 4096, 64)
    assert call["q"].dtype == torch.bfloat16 and call["enable_gqa"] and call["is_causal"]
    assert flash_ineligible(call) == []


def test_what_would_leave_flash_is_named():
    (fp32,) = sdpa_calls(ONE_B, 64, 1, dtype=torch.float32)
    assert flash_ineligible(fp32) == ["dtype torch.float32"]
    (packed,) = sdpa_calls(ONE_B, 64, 1, packed=True)  # packed, off CUDA: a dense mask (CUDA: FlexAttention)
    assert "a dense attention mask (packed documents)" in flash_ineligible(packed)


def test_the_report_names_the_kernel_that_ran():
    report = sdpa_report(ModelConfig(preset="tiny", n_kv_heads=2), 16, 1, torch.device("cpu"))
    assert report["backend"] == "flash" and report["strict"] == "ok", report
    assert "aten::_scaled_dot_product_flash_attention_for_cpu_backward" in report["ops"]
