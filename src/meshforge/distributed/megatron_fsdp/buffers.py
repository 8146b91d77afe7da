"""Flat, padded per-unit buffers of Megatron-FSDP: layout arithmetic and storage management.

A *unit* (a transformer block, or "everything else") owns:

- `compute`: one flat buffer in the compute dtype holding every parameter of the
  unit back to back, padded to a multiple of the data-parallel size N. The
  model's parameters are re-created as views into it (`Tensor.set_` onto its
  storage, so each parameter keeps its own autograd version counter), so model
  code never changes. Under `optim_grads_params` its storage is freed at rest
  (`untyped_storage().resize_(0)`) and regrown before each all-gather; the views
  stay valid because they point into the same storage object.
- `compute_shard`: this rank's 1/N slice of the compute buffer at rest
  (`optim_grads_params` only; an alias of `main` when the dtypes agree).
- `main`: fp32 parameters the optimizer updates: the whole buffer for
  `no_shard` (an alias of `compute` when the dtypes agree), this rank's slice
  `[r*S, (r+1)*S)` otherwise (S = padded / N).
- `grad_full`: the full flat gradient in the reduce dtype, allocated when the
  first gradient of a step arrives, all-reduced (`no_shard`, `optim`) or
  reduce-scattered (`optim_grads*`, after which it is freed).
- `grad_shard`: the reduced gradient slice (`optim_grads*`); `main_grad`: the fp32
  gradient the optimizer reads (an alias wherever the dtypes allow).

A *frozen* unit (every parameter `requires_grad=False`: a LoRA base; `strategy.parallelize` gives each module's
frozen parameters their own unit) has `compute` (and `compute_shard` under `optim_grads_params`) only: no
`main`, no gradient buffers, no optimizer leaves, so frozen weights cost exactly their compute-dtype values.

The optimizer never sees flat buffers: each parameter contributes one leaf
tensor, the piece of `main` that falls into this rank's range, with `.grad` the
matching piece of `main_grad`. AdamW is elementwise, so stepping the pieces is
exactly stepping the full parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

SHARDED_OPTIM = ("optim", "optim_grads", "optim_grads_params")


# ----------------------------------------------------------------------- layout arithmetic (pure)
def flat_layout(numels: list[int], world: int) -> tuple[list[int], int, int]:
    """(offsets of each parameter, padded total, shard size): parameters back to back, padded to world x shard."""
    offsets, o = [], 0
    for n in numels:
        offsets.append(o)
        o += n
    shard = -(-o // world) if o else 0
    return offsets, shard * world, shard


def local_piece(offset: int, numel: int, lo: int, hi: int) -> tuple[int, int]:
    """The part [a, b) of parameter range [offset, offset+numel) inside [lo, hi); a == b when empty."""
    a, b = max(offset, lo), min(offset + numel, hi)
    return (a, b) if a < b else (a, a)


def row_chunk(dim0: int, world: int, rank: int) -> tuple[int, int]:
    """Rows [start, end) rank `rank` holds under DTensor Shard(0) (torch.chunk semantics, uneven allowed)."""
    size = -(-dim0 // world) if dim0 else 0
    start = min(rank * size, dim0)
    return start, min(start + size, dim0)


# ----------------------------------------------------------------------- storage helpers
def storage_bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.untyped_storage().nbytes()


def free_storage(t: torch.Tensor) -> None:
    if t.untyped_storage().nbytes():
        t.untyped_storage().resize_(0)


def alloc_storage(t: torch.Tensor) -> bool:
    """Regrow a freed buffer; True if it had to be regrown."""
    want = t.numel() * t.element_size()
    if t.untyped_storage().nbytes() == want:
        return False
    t.untyped_storage().resize_(want)
    return True


@dataclass
class ParamSlot:
    names: list[str]  # every FQN of this parameter (tied weights have several)
    module: nn.Module
    attr: str
    shape: torch.Size
    offset: int
    numel: int
    requires_grad: bool
    param: nn.Parameter | None = None  # the model's parameter, a view into `compute`
    piece: tuple[int, int] = (0, 0)  # global flat range of this rank's optimizer piece
    leaf: nn.Parameter | None = None  # optimizer leaf (view into `main`), None when the piece is empty
    # tensor parallelism: the parameter is a DTensor on `tp_mesh`; the buffers pack its local tensor
    tp_mesh: object = None
    placements: tuple = ()
    global_shape: torch.Size | None = None
    global_stride: tuple | None = None

    def local_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's tensor-parallel piece of a full (global) value; the value itself without TP."""
        if self.tp_mesh is None:
            return full
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(full, self.tp_mesh, self.placements, src_data_rank=None).to_local()

    def global_of(self, local: torch.Tensor) -> torch.Tensor:
        """The full (global) value from this rank's local value (an all-gather over tp under TP)."""
        if self.tp_mesh is None:
            return local
        return self.as_dtensor(local).full_tensor()

    def as_dtensor(self, local: torch.Tensor):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, self.tp_mesh, self.placements, run_check=False,
                                  shape=self.global_shape, stride=self.global_stride)

    @property
    def fqn(self) -> str:
        return self.names[0]

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclass
class FlatUnit:
    """One FSDP unit's buffers; see the module docstring for the role of each."""

    name: str
    module: nn.Module
    slots: list[ParamSlot]
    world: int
    rank: int
    mode: str  # no_shard | optim | optim_grads | optim_grads_params
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    device: torch.device
    root: nn.Module | None = None  # the model, to resolve the owners of tied parameter names
    padded: int = 0
    shard: int = 0
    compute: torch.Tensor = field(init=False)
    compute_shard: torch.Tensor | None = field(init=False, default=None)
    main: torch.Tensor | None = field(init=False)  # None in a frozen unit
    grad_full: torch.Tensor | None = field(init=False)
    grad_shard: torch.Tensor | None = field(init=False, default=None)
    main_grad: torch.Tensor | None = field(init=False)
    frozen: bool = field(init=False, default=False)  # no parameter of the unit trains
    # per-step bookkeeping
    ready: int = 0
    grads_seen: bool = False
    reduced: bool = False
    n_grads: int = 0  # parameters of the unit that get a gradient
    done: bool = False  # reduction finished (and post-processed) this step
    work: object = None  # pending async reduction
    gather_work: object = None  # pending async all-gather

    def __post_init__(self):
        _, self.padded, self.shard = flat_layout([s.numel for s in self.slots], self.world)
        self.frozen = not any(s.requires_grad for s in self.slots)
        self.allocate(self.device)

    def allocate(self, device: torch.device) -> None:
        """(Re)make every buffer on `device` (zeros): the meta device while a meta-built model is wrapped, the
        run's device when it is materialised; the parameters' views and the optimizer's leaves are made again
        after (`bind_params`, `make_leaves`)."""
        self.device = device
        dev, f32 = device, torch.float32
        self.compute = torch.zeros(self.padded, dtype=self.compute_dtype, device=dev)
        if self.frozen:  # values only: no fp32 main copy, no gradient buffers, no optimizer pieces
            self.main = self.grad_full = self.main_grad = None
            if self.params_sharded:
                self.compute_shard = torch.zeros(self.shard, dtype=self.compute_dtype, device=dev)
            return
        sharded = self.mode in SHARDED_OPTIM
        if not sharded:
            self.main = self.compute if self.compute_dtype == f32 else torch.zeros(self.padded, dtype=f32, device=dev)
        else:
            self.main = torch.zeros(self.shard, dtype=f32, device=dev)
        if self.params_sharded:
            self.compute_shard = self.main if self.compute_dtype == f32 else \
                torch.zeros(self.shard, dtype=self.compute_dtype, device=dev)
        self.grad_full = torch.zeros(self.padded, dtype=self.reduce_dtype, device=dev)
        if self.grads_sharded:
            free_storage(self.grad_full)
            self.grad_shard = torch.zeros(self.shard, dtype=self.reduce_dtype, device=dev)
            self.main_grad = self.grad_shard if self.reduce_dtype == f32 else torch.zeros(self.shard, dtype=f32,
                                                                                          device=dev)
        else:
            lo, hi = self.opt_range
            self.main_grad = self.grad_full[lo:hi] if self.reduce_dtype == f32 else \
                torch.zeros(hi - lo, dtype=f32, device=dev)
        lo, hi = self.opt_range
        for s in self.slots:
            s.piece = local_piece(s.offset, s.numel, lo, hi)

    # ------------------------------------------------------------------ facts
    @property
    def params_sharded(self) -> bool:
        return self.mode == "optim_grads_params"

    @property
    def grads_sharded(self) -> bool:
        return self.mode in ("optim_grads", "optim_grads_params")

    @property
    def opt_range(self) -> tuple[int, int]:
        """Global flat range [lo, hi) whose optimizer state this rank holds."""
        if self.mode in SHARDED_OPTIM:
            return self.rank * self.shard, (self.rank + 1) * self.shard
        return 0, self.padded

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.slots)

    @property
    def gathered(self) -> bool:
        return storage_bytes(self.compute) > 0

    # ------------------------------------------------------------------ model parameters as views
    def bind_params(self) -> None:
        """Replace every parameter of the unit by a view into `compute` (tied names get the same object)."""
        for s in self.slots:
            p = nn.Parameter(torch.empty(0, dtype=self.compute_dtype, device=self.device),
                             requires_grad=s.requires_grad)
            with torch.no_grad():
                p.set_(self.compute.untyped_storage(), s.offset, s.shape)
            if s.tp_mesh is not None:
                p = nn.Parameter(s.as_dtensor(p.detach()), requires_grad=s.requires_grad)
            s.param = p
            for owner, attr in self._owners(s):
                owner._parameters[attr] = p

    def _owners(self, s: ParamSlot):
        out = [(s.module, s.attr)]
        for name in s.names[1:]:
            mod_path, _, attr = name.rpartition(".")
            out.append((self.root.get_submodule(mod_path) if mod_path else self.root, attr))
        return out

    def make_leaves(self) -> None:
        """Optimizer leaves: each parameter's piece of `main`, `.grad` the same piece of `main_grad`."""
        lo = self.opt_range[0]
        for s in self.slots:
            a, b = s.piece
            if a == b or not s.requires_grad:
                s.leaf = None
                continue
            leaf = nn.Parameter(self.main[a - lo:b - lo], requires_grad=True)
            leaf.grad = self.main_grad[a - lo:b - lo]
            s.leaf = leaf

    # ------------------------------------------------------------------ values
    def set_full_flat(self, flat: torch.Tensor) -> None:
        """Write the unit's full values (fp32, length `padded`) into main, compute shard and compute."""
        lo, hi = self.opt_range
        with torch.no_grad():
            if self.frozen:
                if self.params_sharded:
                    self.compute_shard.copy_(flat[self.rank * self.shard:(self.rank + 1) * self.shard])
                if self.gathered:
                    self.compute.copy_(flat)
                return
            self.main.copy_(flat[lo:hi])
            if self.params_sharded:
                if self.compute_shard is not self.main:
                    self.compute_shard.copy_(self.main)
                if self.gathered:
                    self.compute.copy_(flat)
            elif self.compute is not self.main:
                self.compute.copy_(flat)

    def full_flat_from_params(self, params: dict[str, torch.Tensor]) -> torch.Tensor:
        flat = torch.zeros(self.padded, dtype=torch.float32, device=self.device)
        for s in self.slots:
            src = params[s.fqn]
            flat[s.offset:s.offset + s.numel].copy_(src.reshape(-1))
        return flat

    # ------------------------------------------------------------------ accounting
    def param_bytes_at_rest(self) -> int:
        seen, total = set(), 0
        tensors = [self.main, self.compute_shard] + ([] if self.params_sharded else [self.compute])
        for t in tensors:
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                total += storage_bytes(t)
        return total

    def grad_bytes(self) -> int:
        seen, total = set(), 0
        for t in (self.grad_full, self.grad_shard, self.main_grad):
            if t is None:
                continue
            key = t.untyped_storage().data_ptr() if storage_bytes(t) else id(t)
            if key not in seen:
                seen.add(key)
                total += storage_bytes(t)
        return total
