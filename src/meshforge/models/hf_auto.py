"""Any transformers causal LM behind the model contract (`model.hf_model: <folder or config.json>`).

`HFCausalLM` wraps `AutoModelForCausalLM.from_config(...)` (its modules live under `hf.`, so the parameter
names are transformers' own behind that prefix) and declares what meshforge needs from the model's own class
attributes: blocks from `_no_split_modules`, the tensor-parallel plan from transformers' per-class `_tp_plan`
(styles mapped onto meshforge's; one it cannot map is refused), FLOPs from the config, and an initialisation
per parameter (`init_spec`) so a random start is a function of (seed, name) on every rank and layout.
Forward takes token ids and returns logits (`use_cache=False`, causal, no padding mask).

A folder that holds safetensors also gives the weights: `load_folder_weights` reads them with transformers'
own `from_pretrained` (so its name conversions apply) into the plain model before any sharding, refusing any
missing, unexpected or mis-shaped tensor. Each rank then holds one full fp32 copy (two, briefly, while
copying) on CPU before the strategy shards it.

transformers is an optional extra (`meshforge[hf]`), imported only when `model.hf_model` is set.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import torch
from torch import nn

from meshforge.models import HF_PREFIX as PREFIX  # the wrapper keeps the transformers model at `.hf`
from meshforge.models.args import ModelArgs
from meshforge.models.protocol import InitSpec, Undeclared
from meshforge.models.shapes import pattern_matches

# transformers' tp styles -> meshforge's (models/protocol.py); gather-output and embedding styles only where
# the module is the output head / input embedding (meshforge's vocabulary-parallel loss and embedding)
_TP_STYLES = {"colwise": "colwise", "rowwise": "rowwise", "replicate": "replicate"}
_HEAD_STYLES = ("colwise_gather_output", "colwise_rep")
_EMBEDDING_STYLES = ("embedding_rowwise", "rowwise_rep")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ValueError("model.hf_model needs transformers: pip install 'meshforge[hf]'") from None
    return transformers


# weight files meshforge does not read (pickle or other frameworks): a folder holding only these is refused, so it
# never silently starts from a random initialisation instead
_OTHER_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.gguf", "*.h5", "*.msgpack")


def has_weights(path: str | Path) -> bool:
    """Whether `model.hf_model` is a folder holding safetensors weights (a config.json, or a folder without
    weights, starts from a seeded random initialisation)."""
    p = Path(path).expanduser()
    return p.is_dir() and (any((p / f).is_file() for f in WEIGHT_FILES) or any(p.glob("*.safetensors")))


def _first_line(err: BaseException) -> str:
    """transformers' error, as the one line a refusal quotes (its type when it says nothing)."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


@functools.lru_cache(maxsize=16)
def _config(path: str, mtime: float):
    p = Path(path)
    if not (p / "config.json" if p.is_dir() else p).is_file():
        raise ValueError(f"model.hf_model={path}: no config.json there (give a transformers model folder or its "
                         "config.json)")
    t = _transformers()
    try:
        return t.AutoConfig.from_pretrained(str(p))
    except Exception as err:  # noqa: BLE001 - a damaged or crafted config.json fails in many ways inside transformers
        raise ValueError(f"model.hf_model={path}: transformers cannot read its config ({_first_line(err)})") from None


def hf_config(path: str | Path):
    """transformers' config object for `model.hf_model` (cached per file version)."""
    p = Path(path).expanduser().resolve()
    f = p / "config.json" if p.is_dir() else p
    return _config(str(p), f.stat().st_mtime if f.is_file() else 0.0)


def hf_model_args(path: str | Path) -> ModelArgs:
    """The shape of an hf_model as meshforge's rules and planner read it (vocab, widths, heads, layers, context).
    It describes; it builds nothing (`build_model` builds the transformers model itself)."""
    c = hf_config(path)
    p = Path(path).expanduser()
    other = sorted(f.name for pat in _OTHER_WEIGHTS for f in p.glob(pat)) if p.is_dir() else []
    if other and not has_weights(p):
        raise ValueError(f"model.hf_model={path}: its weights are {other[0]}, not safetensors (meshforge reads no "
                         "pickle): save them with save_pretrained(safe_serialization=True), or give its config.json "
                         "for a random start")
    if getattr(c, "output_router_logits", False):
        raise ValueError(f"model.hf_model={path}: output_router_logits=true asks for the router's auxiliary loss, "
                         "which transformers adds only with labels and meshforge's loss does not: set it false")
    try:
        return _args_of(c, path)
    except (TypeError, ValueError, AttributeError) as err:  # a field of the wrong type or a missing one
        raise ValueError(f"model.hf_model={path}: its config.json does not describe a model meshforge can read "
                         f"({type(err).__name__}: {_first_line(err)[:160]})") from None


def _args_of(c, path: str | Path) -> ModelArgs:
    dim, heads = int(c.hidden_size), int(c.num_attention_heads)
    head_dim = getattr(c, "head_dim", None)
    return ModelArgs(vocab_size=int(c.vocab_size), dim=dim, n_layers=int(c.num_hidden_layers), n_heads=heads,
                     n_kv_heads=int(getattr(c, "num_key_value_heads", None) or heads),
                     head_dim=int(head_dim) if head_dim else None,
                     ffn_dim=int(getattr(c, "intermediate_size", None) or 4 * dim),
                     max_seq_len=int(getattr(c, "max_position_embeddings", None) or 2**31 - 1),
                     tie_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
                     init_std=float(getattr(c, "initializer_range", 0.02)),
                     bos_token_id=getattr(c, "bos_token_id", None), eos_token_id=getattr(c, "eos_token_id", None),
                     pad_token_id=getattr(c, "pad_token_id", None),
                     hf_model=str(Path(path).expanduser().resolve()))


def build_hf_model(args: ModelArgs) -> HFCausalLM:
    """The transformers model of `args.hf_model`, in fp32, on the current default device (meta or CPU)."""
    t = _transformers()
    try:
        inner = t.AutoModelForCausalLM.from_config(hf_config(args.hf_model), attn_implementation="sdpa",
                                                   dtype=torch.float32)
    except (ValueError, KeyError, ImportError) as err:  # e.g. not a causal LM, or no SDPA attention
        raise ValueError(f"model.hf_model={args.hf_model}: transformers cannot build it as a causal LM with SDPA "
                         f"attention ({_first_line(err)})") from None
    open_ = sorted({type(m).__name__ for m in inner.modules() if getattr(m, "is_causal", True) is False})
    if open_:  # e.g. BERT without is_decoder: every token would see the ones it is trained to predict
        raise ValueError(f"model.hf_model={args.hf_model}: {type(inner).__name__}'s {open_[0]} attends to later "
                         "tokens (is_causal=False); meshforge trains next-token prediction: use a causal model (for "
                         "an encoder that can decode, set is_decoder: true in its config.json)")
    return HFCausalLM(inner, args.hf_model)


class HFCausalLM(Undeclared, nn.Module):
    """A transformers `PreTrainedModel` (for causal LM) implementing the model contract: blocks, its own TP
    plan, initialisation and FLOPs declared; no pipeline split, CP, MoE layers, LoRA layout or fused loss."""

    def __init__(self, inner: nn.Module, source: str):
        super().__init__()
        self.hf = inner
        self.source = source  # the model.hf_model folder or config.json

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=tokens, use_cache=False).logits

    # ------------------------------------------------------------ declared plans
    def blocks(self) -> list[nn.Module]:
        names = set(getattr(self.hf, "_no_split_modules", None) or ())
        return [m for m in self.hf.modules() if type(m).__name__ in names]

    def tp_plan(self, sequence_parallel: bool = False) -> dict[str, str] | None:
        """transformers' own plan (`_tp_plan`, with the base model's under its prefix), in meshforge's styles."""
        if sequence_parallel:
            raise ValueError("distributed.sequence_parallel=true with model.hf_model is not supported (transformers' "
                             "plans do not say where activations are sequence-sharded): set it false")
        plan = dict(getattr(self.hf, "_tp_plan", None) or {})
        if not plan:
            return None
        head, emb = self.hf.get_output_embeddings(), self.hf.get_input_embeddings()
        out = {}
        for pattern, style in plan.items():
            mods = [m for n, m in self.hf.named_modules() if n and pattern_matches(pattern, n)]
            if style in _TP_STYLES:
                out[PREFIX + pattern] = _TP_STYLES[style]
            elif style in _HEAD_STYLES and mods and all(m is head for m in mods):
                out[PREFIX + pattern] = "vocab_output"
            elif style in _EMBEDDING_STYLES and mods and all(m is emb for m in mods):
                out[PREFIX + pattern] = "vocab_embedding"
            else:
                raise ValueError(f"model.hf_model: {type(self.hf).__name__}'s tp plan gives {pattern!r} style "
                                 f"{style!r}, which meshforge cannot map (it maps colwise, rowwise, replicate, "
                                 "the output head's gather and the embedding's rowwise): set distributed.tp_size 1")
        return out

    def init_spec(self, name: str) -> InitSpec:
        """Linear and Embedding weights normal(initializer_range), their biases zero; any other parameter takes
        the constant transformers' own `_init_weights` gives it (ones or zeros, e.g. a norm), else it is refused."""
        mod_name, _, attr = name.rpartition(".")
        mod = self.get_submodule(mod_name)
        if isinstance(mod, (nn.Linear, nn.Embedding)):
            if attr == "weight":
                return InitSpec("normal", float(getattr(self.hf.config, "initializer_range", 0.02)))
            if attr == "bias":
                return InitSpec("zeros")
        return _constant_init(self.hf, mod, attr, name)

    def flops_per_token(self, seq_len: int) -> float:
        """6 x the parameters a token multiplies by (all but the input embedding; a tied head counts) plus causal
        attention, 6 * layers * hidden * seq (as the built-in models count it)."""
        emb = self.hf.get_input_embeddings()
        head = self.hf.get_output_embeddings()
        matmul = sum(p.numel() for p in self.parameters()) - emb.weight.numel()
        if head is not None and head.weight is emb.weight:
            matmul += head.weight.numel()
        c = self.hf.config
        heads = int(c.num_attention_heads)
        hd = int(getattr(c, "head_dim", None) or c.hidden_size // heads)
        return 6 * matmul + 6 * int(c.num_hidden_layers) * heads * hd * seq_len

    def state_dict_adapter(self):
        raise ValueError(f"{type(self.hf).__name__} (model.hf_model) keeps transformers' own names: "
                         "`meshforge checkpoint export` writes it with save_pretrained")



_CONSTANTS: dict[tuple[type, str], InitSpec | None] = {}


def _constant_init(hf: nn.Module, mod: nn.Module, attr: str, name: str) -> InitSpec:
    """ones/zeros when transformers initialises `mod.<attr>` to that constant (probed on a CPU copy, once per
    module class); anything else has no seeded equivalent here and is refused."""
    key = (type(mod), attr)
    if key not in _CONSTANTS:
        spec = None
        probe = copy.deepcopy(mod).to_empty(device="cpu", recurse=False)
        with torch.no_grad():
            getattr(probe, attr).fill_(float("nan"))
            hf._init_weights(probe)
            value = getattr(probe, attr)
        for kind, const in (("ones", 1.0), ("zeros", 0.0)):
            if bool((value == const).all()):
                spec = InitSpec(kind)
        _CONSTANTS[key] = spec
    if _CONSTANTS[key] is None:
        raise ValueError(f"model.hf_model: parameter {name[len(PREFIX):]} ({type(mod).__name__}.{attr}) has no "
                         "seeded initialisation in meshforge: give a folder with its weights (safetensors)")
    return _CONSTANTS[key]


@torch.no_grad()
def load_folder_weights(model: nn.Module) -> bool:
    """An hf_model folder's safetensors into the plain (unsharded) model, through transformers' `from_pretrained`;
    any missing, unexpected or mis-shaped tensor is refused. Returns whether weights were loaded."""
    if not isinstance(model, HFCausalLM):
        return False
    path = model.source
    if not has_weights(path):
        return False
    t = _transformers()
    t.utils.logging.disable_progress_bar()
    loaded, info = t.AutoModelForCausalLM.from_pretrained(path, config=model.hf.config, dtype=torch.float32,
                                                          attn_implementation="sdpa", output_loading_info=True)
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        bad = sorted(str(k) for k in info.get(key) or ())
        if bad:
            raise ValueError(f"model.hf_model={path}: {key.replace('_', ' ')} loading its safetensors "
                             f"({len(bad)}: {', '.join(bad[:3])}); refusing a partly loaded model")
    model.hf.load_state_dict(loaded.state_dict(), strict=True)
    return True
