"""`MegatronFSDPStrategy`: the `Strategy` protocol over per-unit flat buffers (see `buffers.py`).

Lifecycle of one step (optim_grads_params, the default):
  forward   root pre-hook gathers the root unit and prefetches block 0; each block's pre-hook waits for its
            gather and prefetches the next; each block but the last frees its buffer after forward and puts a
            hook on its output tensor, which gathers it again (and prefetches the previous block) as soon as
            backward reaches it.
  backward  each parameter's post-accumulate-grad hook adds its `.grad` into the unit's flat grad buffer and
            drops `.grad`; when a unit has all its grads and this is the last micro-batch, the unit's buffer
            is reduce-scattered (all-reduced for no_shard/optim) and, under optim_grads_params, freed.
  sync      `finish_grad_sync` reduces any unit whose count did not complete (unused params), waits for
            outstanding reductions, divides by N unless `average_in_collective`, and frees full buffers.
  clip      the global norm is the sum of squares of this rank's grad pieces (no padding), all-reduced.
  step      a plain torch AdamW over per-parameter pieces of the fp32 main shard; `after_optimizer_step`
            copies main -> compute shard and all-gathers for optim/optim_grads.

Frozen parameters (a LoRA base): each module's frozen parameters get a unit of their own (`FlatUnit.frozen`:
values only, no fp32 main copy, no gradient buffer, no optimizer state, never reduced or re-gathered after a
step). The module's units are gathered and prefetched together; under optim_grads_params a block's frozen unit
is freed once backward has produced the gradient of the block's input (every use of a frozen weight lies on
that path), else at `finish_grad_sync`.

Overlap: with `overlap_param_gather` / `overlap_grad_reduce` (default on for CUDA, off for CPU) the
collectives are issued with `async_op=True` and waited for at first use; NCCL runs them on its own
streams, so they overlap compute. The code path is device-agnostic; on CPU/gloo it also works
(background threads), and with the flags off it runs synchronously.

Accounting read by the benchmarks (stable names):
  `strategy.comm_bytes`  Counter {all_gather, reduce_scatter, all_reduce, grad_norm, checkpoint} -> bytes
                         handed to collectives since the last `strategy.reset_comm()`.
  `strategy.comm_calls`  the same keys -> number of calls.
  `strategy.memory_report(optimizer=None)` -> dict of bytes per rank: params_at_rest, grads (held now),
                         grads_peak, optimizer_state, gathered_peak (largest sum of full compute buffers
                         alive at once), units, largest_unit_bytes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from meshforge.distributed.megatron_fsdp.buffers import (
    SHARDED_OPTIM,
    FlatUnit,
    ParamSlot,
    alloc_storage,
    free_storage,
    row_chunk,
    storage_bytes,
)
from meshforge.distributed.megatron_fsdp.comm import CommCounter
from meshforge.distributed.env import policy_device_type
from meshforge.distributed.strategy import Strategy
from meshforge.models import blocks_of, param_init_tensor, persistent_buffers


class MegatronFSDPStrategy(Strategy):
    def __init__(self, dcfg, mesh_ctx, device: torch.device, compute_dtype: torch.dtype | None = None):
        super().__init__(dcfg, mesh_ctx, device)
        cuda, o = policy_device_type(device) == "cuda", self.options
        self.mode = o.sharding_strategy
        self.avg_in_collective = bool(o.average_in_collective)
        self.compute_dtype = compute_dtype or (torch.bfloat16 if cuda else torch.float32)
        fp32_reduce = True if o.grad_reduce_in_fp32 is None else o.grad_reduce_in_fp32
        self.reduce_dtype = torch.float32 if fp32_reduce else self.compute_dtype
        self.overlap_grad = cuda if o.overlap_grad_reduce is None else o.overlap_grad_reduce
        self.overlap_param = cuda if o.overlap_param_gather is None else o.overlap_param_gather
        if mesh_ctx.world_size > 1:
            self.group = mesh_ctx.group("dp_cp")
            self.world, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
            self.dp_mesh = mesh_ctx.mesh("dp_cp")
        else:
            self.group, self.world, self.rank, self.dp_mesh = None, 1, 0, None
        self.comm = CommCounter(self.group, self.world)
        self.units: list[FlatUnit] = []
        self.blocks: list[list[FlatUnit]] = []  # per block: its trainable and/or frozen unit
        self.root_parts: list[FlatUnit] = []  # the units of everything outside the blocks
        self._is_last = True
        self.gathered_peak = 0
        self.grads_peak = 0

    @property
    def active(self) -> bool:
        return True  # buffers and hooks at every size; at dp size 1 no collective runs

    @property
    def holds_masters(self) -> bool:
        return True  # its fp32 main buffers; bf16_params makes the compute buffers bf16 (on CPU too)

    @property
    def comm_bytes(self):
        return self.comm.bytes

    @property
    def comm_calls(self):
        return self.comm.calls

    def reset_comm(self) -> None:
        self.comm.reset()

    def comm_bytes_total(self) -> int:
        return sum(self.comm.bytes.values())

    # ================================================================== wrapping
    def parallelize(self, model: nn.Module) -> nn.Module:
        if self.param_dtype is not None:  # bf16_params: bf16 compute buffers beside the fp32 main ones
            self.compute_dtype = self.param_dtype
            if self.options.grad_reduce_in_fp32 is False:  # (refused by the config rules)
                self.reduce_dtype = self.compute_dtype
        names: dict[int, list[str]] = {}
        params: dict[int, nn.Parameter] = {}
        for fqn, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(fqn)
            params[id(p)] = p
        unit_classes = self.options.fsdp_unit_classes or self.dcfg.block_classes or None
        blocks = blocks_of(model, unit_classes)
        owner: dict[int, int] = {}
        for i, b in enumerate(blocks):
            for p in b.parameters():
                owner.setdefault(id(p), i)
        meta = any(p.is_meta for p in params.values())
        groups: list[list[int]] = [[] for _ in range(len(blocks) + 1)]
        for pid in params:  # model order
            groups[owner.get(pid, len(blocks))].append(pid)
        modules = list(blocks) + [model]
        self.blocks = [[] for _ in blocks]
        for i, pids, frozen in [(i, [q for q in pids if params[q].requires_grad != frozen], frozen)
                                for i, pids in enumerate(groups) for frozen in (False, True)]:
            if not pids:
                continue
            slots, off = [], 0
            for pid in pids:
                p, fqn = params[pid], names[pid][0]
                mod_path, _, attr = fqn.rpartition(".")
                local = p.to_local() if isinstance(p, DTensor) else p
                slot = ParamSlot(names[pid], model.get_submodule(mod_path) if mod_path else model, attr,
                                 local.shape, off, local.numel(), p.requires_grad)
                if isinstance(p, DTensor):  # tensor parallel: pack the local tensor, keep the DTensor view
                    slot.tp_mesh, slot.placements = p.device_mesh, tuple(p.placements)
                    slot.global_shape, slot.global_stride = p.shape, p.stride()
                slots.append(slot)
                off += local.numel()
            name = ("root" if i == len(blocks) else f"unit{i}") + ("_frozen" if frozen else "")
            # a meta-built model gets its buffers when it is materialised (`materialize`), on the meta device until
            u = FlatUnit(name, modules[i], slots, self.world, self.rank, self.mode, self.compute_dtype,
                         self.reduce_dtype, torch.device("meta") if meta else self.device, root=model)
            flat = None if meta else u.full_flat_from_params(
                {s.fqn: _local(params[pid]).detach().to(self.device, torch.float32) for s, pid in zip(slots, pids)})
            u.bind_params()
            u.make_leaves()
            if flat is not None:
                u.set_full_flat(flat)
            if u.params_sharded:
                free_storage(u.compute)
            self.units.append(u)
            (self.blocks[i] if i < len(blocks) else self.root_parts).append(u)
        self.blocks = [b for b in self.blocks if b]
        self._register_grad_hooks()
        self._register_hooks(model)
        return model

    def _register_grad_hooks(self) -> None:
        for u in self.units:
            for s in u.slots:
                if s.requires_grad:
                    s.param.register_post_accumulate_grad_hook(self._grad_hook(u, s))
            u.n_grads = sum(s.requires_grad for s in u.slots)

    def _register_hooks(self, model: nn.Module) -> None:
        for parts in self.blocks:
            parts[0].module.register_forward_pre_hook(lambda m, a, parts=parts: self._pre_forward(parts, a))
            parts[0].module.register_forward_hook(lambda m, a, out, parts=parts: self._post_forward(parts, out))
        # the root hooks also run when every parameter lives in the blocks (root_parts empty)
        model.register_forward_pre_hook(lambda m, a: self._pre_forward(self.root_parts, ()))
        model.register_forward_hook(lambda m, a, out: self._post_forward_root())

    # ================================================================== gather / free
    def _gather(self, u: FlatUnit | None, async_op: bool) -> None:
        if u is None or not u.params_sharded or u.gather_work is not None or u.gathered:
            return
        alloc_storage(u.compute)
        self.gathered_peak = max(self.gathered_peak, sum(storage_bytes(x.compute) for x in self.units
                                                         if x.params_sharded))
        u.gather_work = self.comm.all_gather(u.compute, u.compute_shard, async_op=async_op) or None

    def _ensure_gathered(self, u: FlatUnit | None) -> None:
        if u is None or not u.params_sharded:
            return
        self._gather(u, async_op=False)
        if u.gather_work is not None:
            u.gather_work.wait()
            u.gather_work = None

    def _reshard(self, u: FlatUnit) -> None:
        if not u.params_sharded:
            return
        if u.gather_work is not None:
            u.gather_work.wait()
            u.gather_work = None
        free_storage(u.compute)

    def _next(self, parts: list[FlatUnit], step: int) -> list[FlatUnit]:
        """The units of the block `step` blocks after `parts` (the first block after the root); [] past the end."""
        if parts is self.root_parts:
            return self.blocks[0] if self.blocks and step == 1 else []
        i = next(j for j, b in enumerate(self.blocks) if b is parts) + step
        return self.blocks[i] if 0 <= i < len(self.blocks) else []

    def _pre_forward(self, parts: list[FlatUnit], args) -> None:
        if self.mode != "optim_grads_params":
            return
        for u in parts:
            self._ensure_gathered(u)
        for u in self._next(parts, 1):
            self._gather(u, async_op=self.overlap_param)
        frozen = [u for u in parts if u.frozen]
        if frozen and parts is not self.root_parts and torch.is_grad_enabled():
            # backward is done with the frozen weights once the block's input has its gradient
            def free_frozen(grad):
                for u in frozen:
                    self._reshard(u)
                return grad

            for t in _tensors(args):
                t.register_hook(free_frozen)

    def _post_forward(self, parts: list[FlatUnit], out):
        if self.mode != "optim_grads_params":
            return out
        if not torch.is_grad_enabled():
            for u in parts:
                self._reshard(u)
            return out
        if parts is self.blocks[-1]:
            return out  # backward needs it at once
        tensors = _tensors(out)
        if not tensors:
            return out
        for u in parts:
            self._reshard(u)
        fired = [False]

        def pre_backward(grad, parts=parts):
            if not fired[0]:
                fired[0] = True
                for u in parts:
                    self._ensure_gathered(u)
                for u in self._next(parts, -1):
                    self._gather(u, async_op=self.overlap_param)
            return grad

        for t in tensors:
            t.register_hook(pre_backward)
        return out

    def _post_forward_root(self) -> None:
        if self.mode == "optim_grads_params" and not torch.is_grad_enabled():
            # (a forward without gradients, e.g. validation: nothing will free the units later; the fused loss
            # still reads the head's weight in the root unit, which the next step's backward frees)
            keep = self.root_parts if self.head_read_after_forward else []
            for u in self.units:
                if not any(u is k for k in keep):
                    self._reshard(u)

    # ================================================================== gradients
    def _grad_hook(self, u: FlatUnit, s: ParamSlot):
        def hook(p: torch.Tensor) -> None:
            if p.grad is None:
                return
            self._ensure_grad_buffer(u)
            g = p.grad
            if isinstance(g, DTensor):
                if tuple(g.placements) != s.placements:
                    g = g.redistribute(s.tp_mesh, s.placements)
                g = g.to_local()
            u.grad_full[s.offset:s.offset + s.numel].view(s.shape).add_(g)
            p.grad = None
            u.ready += 1
            if u.ready == u.n_grads:
                u.ready = 0
                if self._is_last:
                    self._reduce(u)
                self._reshard(u)

        return hook

    def _ensure_grad_buffer(self, u: FlatUnit) -> None:
        if u.grads_seen:
            return
        alloc_storage(u.grad_full)
        u.grad_full.zero_()
        u.grads_seen = True
        self.grads_peak = max(self.grads_peak, self.grad_bytes())

    def _reduce(self, u: FlatUnit) -> None:
        if u.reduced:
            return
        self._ensure_grad_buffer(u)
        avg = self.avg_in_collective
        if u.grads_sharded:
            u.work = self.comm.reduce_scatter(u.grad_shard, u.grad_full, avg=avg, async_op=self.overlap_grad)
        else:
            u.work = self.comm.all_reduce(u.grad_full, avg=avg, async_op=self.overlap_grad)
        u.reduced = True
        if not self.overlap_grad:
            self._complete_reduce(u)

    def _complete_reduce(self, u: FlatUnit) -> None:
        if u.work is not None:
            u.work.wait()
            u.work = None
        reduced = u.grad_shard if u.grads_sharded else u.grad_full
        if not self.avg_in_collective and self.world > 1:
            reduced.div_(self.world)  # divide after the (sum) collective
        if u.reduce_dtype != torch.float32:  # the optimizer reads an fp32 copy
            lo, hi = (0, u.shard) if u.grads_sharded else u.opt_range
            u.main_grad.copy_(reduced[lo:hi])
        if u.grads_sharded:
            free_storage(u.grad_full)
            u.grads_seen = False
        u.done = True

    @contextlib.contextmanager
    def micro_step(self, model: nn.Module, is_last: bool) -> Iterator[None]:
        self._is_last = is_last
        for u in self.units:
            u.ready = 0
        try:
            yield
        finally:
            self._is_last = True
        if not is_last:
            for u in self.units:
                self._reshard(u)

    def finish_grad_sync(self, model: nn.Module) -> None:
        for u in self.units:  # same order on every rank
            if not u.reduced and not u.frozen:
                self._reduce(u)
        for u in self.units:
            if not u.done and not u.frozen:
                self._complete_reduce(u)
            self._reshard(u)
            u.reduced, u.done, u.ready = False, False, 0

    def zero_grad(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        for u in self.units:
            if u.frozen:
                continue
            if u.grads_sharded:
                free_storage(u.grad_full)
                u.grad_shard.zero_()
            else:
                u.grad_full.zero_()
            if u.reduce_dtype != torch.float32:
                u.main_grad.zero_()
            u.grads_seen = u.reduced = u.done = False
            u.ready = 0
        for s in self._all_slots():  # a parameter that escaped the hooks (e.g. used outside forward)
            if s.param is not None:
                s.param.grad = None

    # ================================================================== norm and optimizer
    def _leaves(self) -> list[tuple[ParamSlot, nn.Parameter]]:
        return [(s, s.leaf) for s in self._all_slots() if s.leaf is not None]

    def _all_slots(self) -> list[ParamSlot]:
        return [s for u in self.units for s in u.slots]

    def optimizer_param_groups(self, model: nn.Module, weight_decay: float) -> list[dict]:
        decay, no_decay = [], []
        for s, leaf in self._leaves():
            (decay if s.ndim >= 2 else no_decay).append(leaf)
        groups = [{"params": decay, "weight_decay": weight_decay}]
        if no_decay:
            groups.append({"params": no_decay, "weight_decay": 0.0})
        return groups

    def clip_grad_norm_(self, model: nn.Module, max_norm: float | None) -> torch.Tensor:
        pairs = self._leaves()
        leaves = [leaf for _, leaf in pairs]
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        sq_tp = torch.zeros((), dtype=torch.float32, device=self.device)
        for s, leaf in pairs:
            # a tp-sharded parameter: different pieces on each tp rank; a replicated one (a LoRA factor beside a
            # sharded base, a norm under SP) is whole on every tp rank and counts once
            if s.tp_mesh is not None and any(pl.is_shard() for pl in s.placements):
                sq_tp += leaf.grad.float().pow(2).sum()
            else:
                sq += leaf.grad.float().pow(2).sum()
        if self.mesh_ctx.tp_size > 1:
            dist.all_reduce(sq_tp, group=self.mesh_ctx.group("tp"))
            self.comm.calls["grad_norm_tp"] += 1
        sq = sq + sq_tp
        if self.mode in SHARDED_OPTIM:
            self.comm.all_reduce(sq, avg=False, kind="grad_norm")
        norm = sq.sqrt()
        if max_norm is not None:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for leaf in leaves:
                leaf.grad.mul_(coef.to(leaf.grad.dtype))
        return norm

    def after_optimizer_step(self, model: nn.Module) -> None:
        works = []
        for u in self.units:
            if u.frozen:  # unchanged by the step
                continue
            if self.mode == "no_shard":
                if u.compute is not u.main:
                    u.compute.copy_(u.main)
            elif u.params_sharded:
                if u.compute_shard is not u.main:
                    u.compute_shard.copy_(u.main)
            else:
                src = u.main if u.compute_dtype == torch.float32 else u.main.to(u.compute_dtype)
                works.append(self.comm.all_gather(u.compute, src, async_op=self.overlap_param))
        for w in works:
            if w is not None:
                w.wait()

    # ================================================================== init
    def materialize(self, model: nn.Module, seed: int, init: bool = True,
                    names: dict[str, str] | None = None) -> nn.Module:
        names = names or {}
        for m in model.modules():
            for k, b in list(m._buffers.items()):
                if b is not None and b.is_meta:
                    m._buffers[k] = torch.zeros_like(b, device=self.device)
        if any(u.device.type == "meta" for u in self.units):  # built on meta: the buffers, the views into them
            for u in self.units:
                u.allocate(self.device)
                u.bind_params()
                u.make_leaves()
                if u.params_sharded:
                    free_storage(u.compute)
            self._register_grad_hooks()
        for u in self.units:
            flat = torch.zeros(u.padded, dtype=torch.float32, device=self.device)
            for s in u.slots if init else ():
                shape = tuple(s.global_shape if s.global_shape is not None else s.shape)
                full = s.local_of(param_init_tensor(model, names.get(s.fqn, s.fqn), shape, seed).to(self.device))
                flat[s.offset:s.offset + s.numel].copy_(full.reshape(-1))
            u.set_full_flat(flat)
        return model

    # ================================================================== state dicts (fsdp_dtensor)
    def _gather_flat(self, u: FlatUnit, local: torch.Tensor) -> torch.Tensor:
        if self.mode not in SHARDED_OPTIM or self.world == 1:
            return local
        out = torch.empty(u.padded, dtype=local.dtype, device=self.device)
        self.comm.all_gather(out, local.contiguous(), kind="checkpoint")
        return out

    def _values(self, u: FlatUnit) -> torch.Tensor:
        """The unit's full flat values in fp32 (a frozen unit's from its compute buffer or shard)."""
        if not u.frozen:
            return self._gather_flat(u, u.main)
        if not u.params_sharded:
            return u.compute.float()
        return self._gather_flat(u, u.compute_shard.float())

    def _sharded(self, full: torch.Tensor, s: ParamSlot):
        """This rank's value of `s` (its tp-local tensor, whole over dp) -> a DTensor for DCP: Shard(0) on the dp mesh
        (FSDP2's layout), or, under tensor parallelism, the tp DTensor itself (replicated over dp); a plain clone
        at world size 1."""
        if s.tp_mesh is not None:
            return s.as_dtensor(full.detach().clone())
        if self.dp_mesh is None:
            return full.detach().clone()
        from torch.distributed.tensor import DTensor, Shard

        a, b = row_chunk(full.shape[0], self.world, self.rank)
        return DTensor.from_local(full[a:b].detach().clone(), self.dp_mesh, [Shard(0)], run_check=False,
                                  shape=full.shape, stride=full.stride())

    @staticmethod
    def _full(v) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        return v.full_tensor() if isinstance(v, DTensor) else v

    def model_state_dict(self, model: nn.Module, full: bool = False) -> dict:
        """{fqn: DTensor Shard(0) over the dp mesh} in fp32, FSDP2's layout (tied names share a tensor); with
        `full`, plain full tensors."""
        if full:
            return self.full_state_dict(model)
        out = {}
        for u in self.units:
            full = self._values(u)
            for s in u.slots:
                t = self._sharded(full[s.offset:s.offset + s.numel].view(s.shape), s)
                for n in s.names:
                    out[n] = t
        out.update(persistent_buffers(model))  # outside the flat buffers, whole on every rank
        return out

    def load_model_state_dict(self, model: nn.Module, sd: dict) -> None:
        """A frozen unit none of whose names `sd` holds keeps its values (an adapter-only checkpoint)."""
        with torch.no_grad():
            for n, b in persistent_buffers(model):
                if n in sd:
                    b.copy_(self._full(sd[n]))
        for u in self.units:
            if u.frozen and not any(s.fqn in sd for s in u.slots):
                continue
            flat = torch.zeros(u.padded, dtype=torch.float32, device=self.device)
            for s in u.slots:
                if s.fqn not in sd:
                    raise KeyError(f"model state dict has no entry {s.fqn!r}")
                full = self._full(sd[s.fqn]).to(self.device, torch.float32)
                flat[s.offset:s.offset + s.numel].copy_(s.local_of(full).reshape(-1))
            u.set_full_flat(flat)

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Every parameter as a full tensor on every rank (for parity checks and consolidated export)."""
        out = {}
        for u in self.units:
            full = self._values(u)
            for s in u.slots:
                for n in s.names:
                    out[n] = s.global_of(full[s.offset:s.offset + s.numel].view(s.shape)).clone()
        out.update({n: b.clone() for n, b in persistent_buffers(model)})
        return out

    def _group_fqns(self, optimizer) -> list[list[str]]:
        by_leaf = {id(s.leaf): s.fqn for s, _ in self._leaves()}
        return [[by_leaf[id(p)] for p in g["params"] if id(p) in by_leaf] for g in optimizer.param_groups]

    def optimizer_state_dict(self, models: list[nn.Module], optimizer: torch.optim.Optimizer,
                             full: bool = False) -> dict:
        """{"state": {fqn: {"step": tensor, <key>: DTensor Shard(0)}}, "param_groups": [{..., "params": fqns}]}.

        The same FQN-keyed structure DCP's `get_optimizer_state_dict` gives for FSDP2. Before the first step
        (no state yet) exp_avg / exp_avg_sq are zeros, so DCP can load into it.
        """
        keys, step = set(), 0.0
        for _, leaf in self._leaves():
            st = optimizer.state.get(leaf, {})
            step = max(step, float(st["step"])) if "step" in st else step
            keys |= {k for k, v in st.items() if torch.is_tensor(v) and v.shape == leaf.shape and v.dim() > 0}
        keys = sorted(keys) or ["exp_avg", "exp_avg_sq"]
        if self.world > 1:  # every rank must agree (a rank can hold no piece at all)
            t = torch.tensor([step], dtype=torch.float64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
            step = float(t.item())
        state = {}
        for u in self.units:
            if u.frozen:
                continue
            lo, hi = u.opt_range
            fulls = {}
            for k in keys:
                local = torch.zeros(hi - lo, dtype=torch.float32, device=self.device)
                for s in u.slots:
                    if s.leaf is not None and k in optimizer.state.get(s.leaf, {}):
                        a, b = s.piece
                        local[a - lo:b - lo].copy_(optimizer.state[s.leaf][k])
                fulls[k] = self._gather_flat(u, local)
            for s in u.slots:
                if not s.requires_grad:
                    continue
                entry = {k: self._sharded(fulls[k][s.offset:s.offset + s.numel].view(s.shape), s) for k in keys}
                entry["step"] = torch.tensor(step, dtype=torch.float32)
                state[s.fqn] = entry
        groups = []
        for g, fqns in zip(optimizer.param_groups, self._group_fqns(optimizer)):
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": fqns})
        if full:  # plain full tensors (every rank takes part in the gathers)
            state = {fqn: {k: self._full(v) for k, v in entry.items()} for fqn, entry in state.items()}
        return {"state": state, "param_groups": groups}

    def load_optimizer_state_dict(self, models: list[nn.Module], optimizer: torch.optim.Optimizer, sd: dict) -> None:
        state = sd["state"]
        for u in self.units:
            for s in u.slots:
                if not s.requires_grad:
                    continue
                if s.fqn not in state:
                    raise KeyError(f"optimizer state dict has no entry {s.fqn!r}")
                entry = state[s.fqn]
                new = {}
                for k, v in sorted(entry.items()):
                    if k == "step":
                        new[k] = torch.tensor(float(v), dtype=torch.float32)
                        continue
                    full = s.local_of(self._full(v).to(self.device, torch.float32))  # collective: every rank
                    if s.leaf is not None:
                        a, b = s.piece
                        new[k] = full.reshape(-1)[a - s.offset:b - s.offset].clone()
                if s.leaf is not None:
                    optimizer.state[s.leaf] = new
        saved = sd.get("param_groups", [])
        for g, fqns in zip(optimizer.param_groups, self._group_fqns(optimizer)):
            for sg in saved:
                if set(fqns) & set(sg.get("params", [])):
                    g.update({k: v for k, v in sg.items() if k != "params"})
                    break

    # ================================================================== accounting
    def grad_bytes(self) -> int:
        return sum(u.grad_bytes() for u in self.units)

    def memory_report(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        opt = 0
        if optimizer is not None:
            for st in optimizer.state.values():
                opt += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v))
        return {
            "params_at_rest": sum(u.param_bytes_at_rest() for u in self.units),
            "params_gathered_now": sum(storage_bytes(u.compute) for u in self.units if u.params_sharded),
            "grads": self.grad_bytes(),
            "grads_peak": self.grads_peak,
            "optimizer_state": opt,
            "gathered_peak": self.gathered_peak,
            "units": len(self.units),
            "largest_unit_bytes": max((u.padded * u.compute.element_size() for u in self.units), default=0),
            "total_param_numel": sum(u.numel for u in self.units),
        }


def _tensors(x) -> list[torch.Tensor]:
    """The tensors of a forward's arguments or output that require grad."""
    return [t for t in (x if isinstance(x, (tuple, list)) else (x,)) if isinstance(t, torch.Tensor) and t.requires_grad]


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p
