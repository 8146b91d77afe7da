"""Regional compilation (`training.compile`): each block compiled with inductor on CPU trains like eager mode.

Inductor reorders fp32 arithmetic, so losses agree to 1e-5 relative and final weights to 2e-4 absolute after 3 AdamW steps at lr 1e-2 (not
bit-equal). Kept to one short run: a cold inductor compile takes ~20 s on a loaded 2-core machine.
"""

import pytest
import torch

from meshforge.distributed.compile import compile_enabled
from meshforge.testing.parity import run_single


def test_compile_auto_is_on_for_cuda_only():
    assert compile_enabled("auto", torch.device("cuda")) and not compile_enabled("auto", torch.device("cpu"))
    assert compile_enabled(True, torch.device("cpu")) and not compile_enabled(False, torch.device("cuda"))


@pytest.mark.slow  # a cold inductor compile: ~20 s idle, minutes on a loaded machine
def test_regional_inductor_compile_with_activation_checkpointing_matches_eager():
    common = ["distributed.activation_checkpointing=full", "training.global_batch_size=4"]
    eager = run_single(common + ["training.compile=false"], steps=3)
    torch._dynamo.reset()
    compiled = run_single(common + ["training.compile=true"], steps=3)
    for a, b in zip(eager.losses, compiled.losses, strict=True):
        assert abs(a - b) <= 1e-5 * abs(a), (eager.losses, compiled.losses)
    worst = max((eager.weights[k] - compiled.weights[k]).abs().max().item() for k in eager.weights)
    assert worst <= 2e-4, worst


def test_compile_backend_is_read_only_with_compile_on():
    from meshforge.config import load_config
    from meshforge.errors import ConfigError

    base = ["model.preset=tiny", "data.source=synthetic", "training.compile_backend=aot_eager"]
    assert load_config(None, base + ["training.compile=true"]).training.compile_backend == "aot_eager"
    with pytest.raises(ConfigError, match="training.compile_backend=aot_eager is not read with training.compile=false"):
        load_config(None, base + ["training.compile=false"])
