"""Any transformers causal LM behind the model contract (`model.hf_model: <folder or config.json>`).

`HFCausalLM` wraps `AutoModelForCausalLM.from_config(...)` (its modules live under `hf.`, so the parameter
names are transformers' own behind that prefix) and declares what meshforge needs from the model's own class
attributes: blocks from `_no_split_modules` (else the layers of its largest ModuleList), the tensor-parallel plan
from transformers' per-class `_tp_plan` (styles mapped onto meshforge's; one it cannot map is refused; per-head
parameters the plan leaves whole are found by `planning/tp_trace.py`), its MoE layers (`hf_auto_moe.py`: fused
experts behind transformers' experts interface, sharded by expert parallelism; the router's aux loss), FLOPs from
the config, and the initialisation (`hf_auto_init.py`: transformers' own `_init_weights`, seeded per module) so a
random start is the same on every rank and layout. Forward takes token ids and returns logits (`use_cache=False`,
causal, no padding mask). LoRA (`adapter_layout`): every `nn.Linear` but the output head, by its own name
(`q_proj`, ...: PEFT's `target_modules`), exported in PEFT's format under transformers' names.

Built in CPU memory, the model is run once on a few tokens (`_check_forward`): one that is not causal or does not
run on token ids alone is refused there, before anything starts; validation does this on `probe_model`'s copy.

A folder that holds safetensors also gives the weights: `load_folder_weights` reads them with transformers'
own `from_pretrained` (so its name conversions apply) into the plain model before any sharding, refusing any
missing, unexpected or mis-shaped tensor. Each rank then holds one full fp32 copy (two, briefly, while
copying) on CPU before the strategy shards it.

transformers is an optional extra (`meshforge[hf]`), imported only when `model.hf_model` is set.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import torch
from torch import nn

from meshforge.models import HF_PREFIX as PREFIX  # the wrapper keeps the transformers model at `.hf`
from meshforge.models.hf_auto_init import seeded_init
from meshforge.models.hf_auto_moe import (
    AUX_COEFFICIENTS,
    HFMoELayer,
    aux_loss_coefficient,
    ep_problem,
    experts_modules,
)
from meshforge.models.args import ModelArgs
from meshforge.models.protocol import AdapterLayout, ForeignModel, InitSpec, PipelineLayout, Undeclared, blocks_of
from meshforge.models.shapes import is_adapter_param, pattern_matches

# transformers' tp styles -> meshforge's (distributed/tensor_parallel.py); on the output head the gather-output
# styles become the vocabulary-parallel loss, on the input embedding the embedding styles its vocabulary sharding
_TP_STYLES = {"colwise": "colwise", "rowwise": "rowwise", "replicate": "replicate",
              "colwise_gather_output": "colwise_gather", "colwise_rep": "colwise_gather",
              "rowwise_split_input": "rowwise_split", "replicated_with_grad_allreduce": "replicate_grad_sum"}
_HEAD_STYLES = ("colwise_gather_output", "colwise_rep")
_EMBEDDING_STYLES = ("embedding_rowwise", "rowwise_rep")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
# architectures (model_type prefix) whose plan maps but whose TP training was measured apart from one process's
# (docs/hf.md): refused under TP until verified, with the measurement
_TP_UNVERIFIED = {"gemma4": "1.3e-3 from one process's weights after 3 steps at tp_size=2, grad norm 1.6e-3; other "
                            "architectures within 3.9e-5; not established as rounding"}


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


def _rebuild(config, rng_seed: int) -> nn.Module:
    """The same transformers model again on CPU, its constructor drawing from `rng_seed`."""
    torch.manual_seed(rng_seed)
    return _transformers().AutoModelForCausalLM.from_config(config, dtype=torch.float32)


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
    if getattr(c, "output_router_logits", False) and not any(hasattr(c, k) for k in AUX_COEFFICIENTS):
        raise ValueError(f"model.hf_model={path}: output_router_logits=true asks for the router's auxiliary loss, "
                         f"but its config names no coefficient ({' or '.join(AUX_COEFFICIENTS)}): set it false")
    try:
        return _args_of(c, path)
    except (TypeError, ValueError, AttributeError) as err:  # a field of the wrong type or a missing one
        if str(err).startswith("model.hf_model="):  # already one line of ours
            raise
        raise ValueError(f"model.hf_model={path}: its config.json does not describe a model meshforge can read "
                         f"({type(err).__name__}: {_first_line(err)[:160]})") from None


def _args_of(c, path: str | Path) -> ModelArgs:
    t = _text_config(c)
    dim = int(_get(t, "hidden_size") or _get(t, "d_model") or 0)
    heads = int(_get(t, "num_attention_heads") or 1)  # a model without attention (Mamba, RWKV): one "head"
    if not dim or _get(t, "vocab_size") is None:
        raise ValueError(f"model.hf_model={path}: its config ({type(c).__name__}) names no hidden_size or "
                         "vocab_size meshforge can read")
    head_dim = _get(t, "head_dim")
    ffn = _get(t, "intermediate_size")
    context = _get(t, "max_position_embeddings")
    return ModelArgs(vocab_size=int(t.vocab_size), dim=dim, n_layers=int(_get(t, "num_hidden_layers") or 1),
                     n_heads=heads, n_kv_heads=int(_get(t, "num_key_value_heads") or heads),
                     head_dim=int(head_dim) if isinstance(head_dim, int) and head_dim else None,
                     ffn_dim=int(max(ffn) if isinstance(ffn, (list, tuple)) else ffn or 4 * dim),
                     max_seq_len=int(context) if isinstance(context, int) and context > 0 else 2**31 - 1,
                     tie_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
                     init_std=float(_get(t, "initializer_range") or 0.02),
                     bos_token_id=_get(t, "bos_token_id"), eos_token_id=_get(t, "eos_token_id"),
                     pad_token_id=_get(t, "pad_token_id"),
                     hf_model=str(Path(path).expanduser().resolve()))


def _text_config(c):
    """The config of the language model inside a composite one (e.g. Gemma 3's `text_config`), else `c`."""
    try:
        return c.get_text_config(decoder=True)
    except Exception:  # a config without sub-configs, or one transformers cannot split
        return c


def _get(c, key: str):
    """`c.key`, or None where the config has none or cannot give one value (e.g. Gemma 4's per-layer head_dim)."""
    try:
        return getattr(c, key, None)
    except Exception:
        return None


PROBE_PARAMS_MAX = 100_000_000  # validation builds a model.hf_model up to this size in CPU memory (400 MB fp32)


def probe_model(args: ModelArgs) -> HFCausalLM:
    """The model validation looks at, without a process group: built in CPU memory (so run once, see
    `_check_forward`) when it has at most PROBE_PARAMS_MAX parameters, else on the meta device (structure only;
    the trainer then checks the rest on its CPU build before the first collective). Cached per file version."""
    key = _file_version(args.hf_model)
    if _PROBED.get("key") != key:
        _PROBED.clear()  # one model at a time: validation looks at one run's model
        with torch.device("meta"):
            model = build_hf_model(args, probe=True)
        if sum(p.numel() for p in model.parameters()) <= PROBE_PARAMS_MAX:
            model = build_hf_model(args, probe=True)  # (CPU: the default device)
        _PROBED.update(key=key, model=model)
    return _PROBED["model"]


_PROBED: dict = {}


def build_hf_model(args: ModelArgs, probe: bool = False) -> HFCausalLM:
    """The transformers model of `args.hf_model`, in fp32, on the current default device (meta or CPU). Built on
    CPU it is also run once (`_check_forward`): a model that cannot run on token ids alone, or that is not causal,
    is refused here, before anything is launched. A build for real (not `probe_model`'s) ends validation: the
    probe's CPU copy is let go."""
    if not probe and torch.get_default_device().type != "meta":
        _PROBED.clear()
    inner = _from_config(hf_config(args.hf_model), args.hf_model)
    key = _file_version(args.hf_model)
    if key not in _FORWARD_CHECKED and not any(p.is_meta for p in inner.parameters()):
        _check_forward(inner, args)
        _FORWARD_CHECKED.add(key)  # (validation's probe and the trainer's build are the same model)
    return HFCausalLM(inner, args.hf_model)


_FORWARD_CHECKED: set = set()


def _file_version(path: str) -> tuple[str, float]:
    p = Path(path)
    f = p / "config.json" if p.is_dir() else p
    return path, f.stat().st_mtime if f.is_file() else 0.0


@torch.no_grad()
def _check_forward(inner: nn.Module, args: ModelArgs) -> None:
    """Two forwards on 6 tokens that differ only in the last: every earlier position must give the same logits
    (causal, up to rounding), measured rather than read from attributes (a BART decoder's unused cross-attention
    is not causal, its self-attention is)."""
    vocab = max(2, min(args.vocab_size, 64))
    a = torch.arange(6).remainder(vocab).unsqueeze(0)
    b = a.clone()
    b[0, -1] = (a[0, -1] + 1) % vocab
    was_training = inner.training
    try:
        with torch.random.fork_rng(devices=[]):
            inner.eval()
            la, lb = (inner(input_ids=x, use_cache=False).logits for x in (a, b))
    except Exception as err:  # e.g. XMOD without a default language, a draft model needing the target's states
        raise ValueError(f"model.hf_model={args.hf_model}: {type(inner).__name__}'s forward does not run on token "
                         f"ids alone ({type(err).__name__}: {_first_line(err)}); meshforge feeds it token ids "
                         "only") from None
    finally:
        inner.train(was_training)
    # relative to the logits' size: rounding (e.g. an expert's matmul over another number of rows) is ~1e-7
    if (la[:, :-1] - lb[:, :-1]).abs().max() > 1e-5 * la.abs().max():
        raise ValueError(f"model.hf_model={args.hf_model}: {type(inner).__name__} is not causal (changing the last "
                         "token changes the logits before it); meshforge trains next-token prediction: use a causal "
                         "model (for an encoder that can decode, set is_decoder: true in its config.json)")


_PACKING: dict = {}
PACKING_RTOL = 1e-5  # relative to the logits' size, as `_check_forward`'s causality


def _batched(positions: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return positions.expand(tokens.shape[0], -1) if positions.dim() == 1 else positions


@torch.no_grad()
def _packing_check(inner: nn.Module) -> str | None:
    """Three documents of 5, 1 and 4 tokens packed in one row, their positions restarting at each (what meshforge
    feeds a packed batch), against each document run alone: a model that keeps them apart (transformers 5 builds a
    document mask from position ids that restart, `masking_utils.find_packed_sequence_indices`) gives each
    document's own logits. One whose attention ignores them (ALiBi or recurrent state, a mask of its own) does not,
    and packing is refused for it."""
    docs = [torch.arange(5), torch.tensor([9]), torch.arange(4) + 3]
    vocab = max(2, min(int(_get(_text_config(inner.config), "vocab_size") or 2), 64))
    docs = [d.remainder(vocab) for d in docs]
    tokens = torch.cat(docs).unsqueeze(0)
    positions = torch.cat([torch.arange(len(d)) for d in docs]).unsqueeze(0)
    was_training = inner.training
    name = type(inner).__name__
    try:
        with torch.random.fork_rng(devices=[]):
            inner.eval()
            packed = inner(input_ids=tokens, position_ids=positions, use_cache=False).logits[0]
            alone = torch.cat([inner(input_ids=d.unsqueeze(0), use_cache=False).logits[0] for d in docs])
    except Exception as err:  # a forward without position ids
        return f"{name}'s forward does not take position ids ({type(err).__name__}: {_first_line(err)})"
    finally:
        inner.train(was_training)
    diff = (packed - alone).abs().max().item()
    if not diff <= PACKING_RTOL * alone.abs().max().item():  # (NaN logits prove nothing: refused too)
        return (f"{name} does not keep packed documents apart through position ids (a document's logits change "
                f"by {diff:.1e} when packed after another)")
    return None


def _from_config(config, source: str) -> nn.Module:
    """`AutoModelForCausalLM.from_config` with SDPA attention, or the model's eager attention where it has no SDPA
    path (e.g. Gemma 2's soft-capping, Bloom's ALiBi); whatever transformers raises is one line."""
    t = _transformers()
    for attn in ("sdpa", "eager"):
        try:
            return t.AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)
        except ValueError as err:
            if attn == "sdpa" and "scaled_dot_product_attention" in str(err):
                continue  # no SDPA path: eager computes the same causal attention
            raise ValueError(f"model.hf_model={source}: transformers cannot build it as a causal LM "
                             f"({_first_line(err)})") from None
        except Exception as err:  # transformers' own checks and bugs (AttributeError, AssertionError, ...)
            raise ValueError(f"model.hf_model={source}: transformers cannot build it as a causal LM "
                             f"({type(err).__name__}: {_first_line(err)})") from None
    raise AssertionError("unreachable")


class HFCausalLM(Undeclared, nn.Module):
    """A transformers `PreTrainedModel` (for causal LM) implementing the model contract: blocks, its own TP
    plan, MoE layers (models/hf_auto_moe.py), LoRA layout, initialisation and FLOPs declared; no pipeline split, CP
    or fused loss."""

    def __init__(self, inner: nn.Module, source: str):
        super().__init__()
        self.hf = inner
        self.source = source  # the model.hf_model folder or config.json
        self._moe = [HFMoELayer(m) for _, m in experts_modules(inner)]
        # output_router_logits: transformers' aux loss, times the coefficient its causal-LM class would use
        self._aux_coef = aux_loss_coefficient(inner) if getattr(inner.config, "output_router_logits", False) else None
        self._init_served: tuple[int, set[str]] | None = None  # (seed, names handed out since the seeded init)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None):
        """Logits; in training with `output_router_logits`, (logits, coefficient x transformers' aux loss).
        Packed sequences: `positions` restart at each document (`document_ids` says the same), and transformers
        builds its document mask from them (`packing_problem` measured that this model does)."""
        out = self.hf(input_ids=tokens, use_cache=False, **({} if positions is None else
                                                             {"position_ids": _batched(positions, tokens)}))
        aux = getattr(out, "aux_loss", None) if self._aux_coef is not None and self.training else None
        return out.logits if aux is None else (out.logits, self._aux_coef * aux)

    def packing_problem(self) -> str | None:
        """Why this model cannot train packed sequences, or None: measured once per config.json version (on CPU),
        see `_packing_check`."""
        if any(p.is_meta for p in self.parameters()):
            return None  # (the trainer's CPU build measures it)
        key = _file_version(self.source)
        if key not in _PACKING:
            _PACKING[key] = _packing_check(self.hf)
        return _PACKING[key]

    # ------------------------------------------------------------ declared plans
    def blocks(self) -> list[nn.Module]:
        """The modules of the classes in `_no_split_modules`; for a class that names none, the layers of its largest
        ModuleList (as for any module meshforge did not define)."""
        names = set(getattr(self.hf, "_no_split_modules", None) or ())
        found = [m for m in self.hf.modules() if type(m).__name__ in names]
        return found or ForeignModel(self.hf).blocks()

    def plan_layout(self, block_classes: list[str] | None = None) -> PipelineLayout:
        """The structure the planner reads (`models.plan_layout`; not a pipeline split: PP is refused): the blocks by
        name in module order, as the runtime finds them (`blocks_of`: FSDP units, checkpointed regions; a parameter
        belongs to the innermost block around it, as FSDP's units hold it), the input embedding (first) and the
        output head (last)."""
        names = {id(m): n for n, m in self.named_modules()}
        blocks = tuple(names[id(b)] for b in blocks_of(self, block_classes))
        emb, head = self.hf.get_input_embeddings(), self.hf.get_output_embeddings()
        return PipelineLayout(blocks, (names[id(emb)],) if id(emb) in names else (),
                              (names[id(head)],) if head is not None and id(head) in names else ())

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
            if style in _HEAD_STYLES and mods and all(m is head for m in mods):
                out[PREFIX + pattern] = "vocab_output"
            elif style in _TP_STYLES:
                out[PREFIX + pattern] = _TP_STYLES[style]
            elif style in _EMBEDDING_STYLES and mods and all(m is emb for m in mods):
                out[PREFIX + pattern] = "vocab_embedding"
            else:
                raise ValueError(f"model.hf_model: {type(self.hf).__name__}'s tp plan gives {pattern!r} style "
                                 f"{style!r}, which meshforge cannot map (it maps {', '.join(_TP_STYLES)}, the "
                                 "output head's gather and the embedding's rowwise): set distributed.tp_size 1")
        model_type = getattr(self.hf.config, "model_type", "") or ""
        for prefix, gap in _TP_UNVERIFIED.items():
            if model_type.startswith(prefix):
                raise ValueError(f"model.hf_model: {type(self.hf).__name__} under tensor parallelism is unverified "
                                 f"({gap}): set distributed.tp_size 1 (data parallelism, and ep_size, without TP "
                                 "train it)")
        return out

    def adapter_layout(self) -> AdapterLayout:
        """LoRA's roles: the model's `nn.Linear` modules (not the output head) by their own name (`q_proj`), or by
        the names above it where one name sits in differently-placed modules (`self_attn.q_proj`,
        `cross_attn.q_proj`); embeddings and `*Norm*` modules for `peft.freeze`. Conv1D (GPT-2) is no Linear."""
        head = self.hf.get_output_embeddings()
        found: dict[str, str] = {}  # pattern -> role
        norms: list[str] = []
        for name, m in self.named_modules():
            pattern = re.sub(r"\.\d+(?=\.|$)", ".*", name)
            if isinstance(m, nn.Linear) and m is not head and not is_adapter_param(name + ".weight") \
                    and not name.rpartition(".")[2].isdigit():  # (a ModuleList's items have no name PEFT can target)
                found.setdefault(pattern, "")
            elif "Norm" in type(m).__name__ and pattern not in norms:
                norms.append(pattern)
        parts = {p: p.split(".") for p in found}
        for pattern, comps in parts.items():  # the shortest tail of names that tells the patterns apart
            for k in range(1, len(comps) + 1):
                tail = ".".join(comps[-k:])
                if "*" not in comps[-k] and sum(".".join(c[-k:]) == tail for c in parts.values()) == 1:
                    found[pattern] = tail
                    break
        embeddings = tuple(n for n, m in self.named_modules()
                           if n and m is not None and m in (self.hf.get_input_embeddings(), head))
        return AdapterLayout(linears={role: p for p, role in found.items() if role}, embeddings=embeddings,
                             norms=tuple(norms))

    def init_spec(self, name: str) -> InitSpec:
        """transformers' own initialisation of the whole model, seeded per module (models/hf_auto_init.py)."""
        return InitSpec("computed", compute=functools.partial(self._initial_value, name))

    def _initial_value(self, name: str, seed: int) -> torch.Tensor:
        # one seeded initialisation (in place) per pass of `models.init_weights`: a name asked for again starts
        # the next pass, so values trained since are never handed out as initial ones
        if self._init_served is None or self._init_served[0] != seed or name in self._init_served[1]:
            self._seeded_init(seed)
        self._init_served[1].add(name)
        return self.get_parameter(name).detach().clone()

    def _seeded_init(self, seed: int) -> None:
        seeded_init(self.hf, seed, lambda rng: _rebuild(self.hf.config, rng), weights_follow=has_weights(self.source))
        self._init_served = (seed, set())

    def check_seeded_start(self, seed: int) -> None:
        """Validation (on `probe_model`'s copy): the random start exists (ValueError naming the parameter if not)."""
        if self._init_served is None or self._init_served[0] != seed:
            self._seeded_init(seed)

    def moe_layers(self) -> list[HFMoELayer]:
        """The routed-experts modules with transformers' experts interface (expert parallelism shards these)."""
        return self._moe

    def expert_parallel_problem(self, ep_size: int) -> str | None:
        """Why expert parallelism over `ep_size` ranks cannot split this model's experts (None: it can)."""
        problem = ep_problem(self.hf)
        if problem:
            return f"{problem}: set ep_size 1"
        bad = sorted({layer.n_experts for layer in self._moe if layer.n_experts % ep_size})
        return f"its {bad[0]} experts per layer do not split over {ep_size} ranks: choose an ep_size dividing " \
               f"{bad[0]}" if bad else None

    def flops_per_token(self, seq_len: int) -> float:
        """6 x the parameters a token multiplies by (all but the input embedding; a tied head counts) plus causal
        attention, 6 * layers * hidden * seq (as the built-in models count it)."""
        emb = self.hf.get_input_embeddings()
        head = self.hf.get_output_embeddings()
        matmul = sum(p.numel() for p in self.parameters()) - emb.weight.numel()
        if head is not None and head.weight is emb.weight:
            matmul += head.weight.numel()
        c = _text_config(self.hf.config)
        heads = int(_get(c, "num_attention_heads") or 0)  # none: no attention (a state-space model)
        hd = int(_get(c, "head_dim") or (int(_get(c, "hidden_size") or 0) // max(heads, 1)))
        return 6 * matmul + 6 * int(_get(c, "num_hidden_layers") or 0) * heads * hd * seq_len

    def state_dict_adapter(self) -> TransformersNames:
        return TransformersNames()


class TransformersNames:
    """The state-dict adapter of an hf_model: its names are transformers' own behind `hf.`, its tensors as they are
    (LoRA's PEFT export and import use it; the whole model is written by transformers' `save_pretrained`)."""

    def hf_names(self, name: str) -> list[str]:
        return [name[len(PREFIX):]] if name.startswith(PREFIX) else []

    def to_hf(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        return {hf: tensor for hf in self.hf_names(name)}

    def from_hf(self, name: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        (tensor,) = tensors.values()
        return tensor


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
    loaded, info = t.AutoModelForCausalLM.from_pretrained(
        path, config=model.hf.config, dtype=torch.float32, output_loading_info=True,
        attn_implementation=model.hf.config._attn_implementation)
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        bad = sorted(str(k) for k in info.get(key) or ())
        if bad:
            raise ValueError(f"model.hf_model={path}: {key.replace('_', ' ')} loading its safetensors "
                             f"({len(bad)}: {', '.join(bad[:3])}); refusing a partly loaded model")
    missing, unexpected = model.hf.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if not is_adapter_param(k)]  # LoRA's factors are not in the base's folder
    if missing or unexpected:
        raise ValueError(f"model.hf_model={path}: its weights do not fit the model ({(missing or unexpected)[0]})")
    return True
