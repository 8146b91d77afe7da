"""Which attention rule each layer of a model follows, without torch: its sliding window and its rotary table.

Gemma 3 and GPT-OSS interleave local layers (a sliding window of `model.sliding_window` keys) with global ones
(the whole causal context), in a fixed period: `model.sliding_window_pattern` N makes layers N-1, 2N-1, ... (every
N-th, counting from 1) global and the others local (transformers' `layer_types` default for both: Gemma 3 N=6,
GPT-OSS N=2); no pattern with a window makes every layer local. Gemma 3's local layers rotate with their own base
(`model.rope_local_theta`, unscaled); its global layers, and every GPT-OSS layer, use `model.rope_theta` with the
model's scaling (`rope_type`).

The model modules (models/gemma3.py, models/gpt_oss.py) read a layer's rule when they build it, the families'
config.json code turns `layer_types` into the pattern and back, and the FLOPs count each layer's keys.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from meshforge.models.args import ModelArgs

SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' `layer_types` entries


class RopeSpec(NamedTuple):
    """One rotary table (models/rope.py computes it): `kind` default | linear | llama3 | yarn and what it reads."""

    theta: float
    kind: str = "default"
    factor: float = 1.0  # linear, llama3, yarn
    original_max: int = 8192  # llama3, yarn: the pre-training context
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn: the ramp between extrapolated and interpolated dimensions
    beta_slow: float = 1.0
    truncate: bool = True  # yarn: round the ramp's bounds to whole dimensions
    attention_factor: float | None = None  # yarn: cos/sin multiplier; None: derived (the mscales, else factor)
    mscale: float | None = None  # yarn: with mscale_all_dim, the derived attention factor's ratio (DeepSeek)
    mscale_all_dim: float | None = None


def layer_kinds(n_layers: int, window: int | None, pattern: int | None) -> list[str]:
    """`layer_types` of a model: every layer global without a window; with one, every `pattern`-th global."""
    if window is None:
        return [FULL] * n_layers
    return [FULL if pattern and (i + 1) % pattern == 0 else SLIDING for i in range(n_layers)]


def is_local(a: ModelArgs, layer: int) -> bool:
    return layer_kinds(layer + 1, a.sliding_window, a.sliding_window_pattern)[layer] == SLIDING


def window_of(a: ModelArgs, layer: int) -> int | None:
    """The sliding window of layer `layer` (None: the whole causal context)."""
    return a.sliding_window if is_local(a, layer) else None


def global_rope(a: ModelArgs) -> RopeSpec:
    """The model's scaled rotary table (`rope_type` and its parameters)."""
    return RopeSpec(a.rope_theta, a.rope_type, a.rope_factor, a.rope_original_max_seq_len, a.rope_low_freq_factor,
                    a.rope_high_freq_factor, a.yarn_beta_fast, a.yarn_beta_slow, a.yarn_truncate,
                    a.yarn_attention_factor, a.yarn_mscale, a.yarn_mscale_all_dim)


def rope_of(a: ModelArgs, layer: int) -> RopeSpec:
    """Layer `layer`'s rotary table: Gemma 3's local layers their own unscaled base, every other layer the global."""
    local_theta = getattr(a, "rope_local_theta", None)
    if local_theta is not None and is_local(a, layer):
        return RopeSpec(local_theta)
    return global_rope(a)


def keys_per_query(window: int | None, seq_len: int) -> float:
    """Mean keys a query attends to in a causal sequence of `seq_len` (the FLOPs' convention: seq_len / 2 for full
    causal attention), within `window` keys: w - w^2 / (2 seq_len) for w < seq_len."""
    if window is None or window >= seq_len:
        return seq_len / 2
    return window - window * window / (2 * seq_len)

