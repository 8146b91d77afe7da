"""`training.nonfinite`: what a step with a non-finite loss or grad norm does, decided on the device.

Every step, `apply` turns (loss, grad norm) into the optimizer's `found_inf`, a 0-dim device tensor that
fused AdamW honours exactly as under a GradScaler: when it is nonzero the step changes no weight, no moment
and no step count. Nothing is read back to the host:
  bad     = loss or grad norm not finite (both are global: the loss is averaged over the data ranks and the
            grad norm taken over every shard, so every rank decides alike)
  in_row  = (in_row + 1) * bad
  halted |= bad (stop) or in_row >= max_skipped (skip)
  found_inf = bad or halted
so after the step that stops the run no update is applied either: the weights stay those of the last good
step until the host learns of it.

The host learns on log steps and before every checkpoint save (`review`): it reads the losses and grad
norms of the steps since the last read (one transfer), replays the same policy to name the steps skipped
and warn about them, and raises `TrainingStopped` naming the step that stopped the run, before anything is
saved for it.

Optimizers without `found_inf` support (foreach, for_loop) cannot skip on the device: for them `apply`
reads the flag on the host every step (one synchronisation per step; the default fused AdamW needs none).
"""

from __future__ import annotations

import math

import torch

from meshforge.errors import TrainingStopped


class NonFinitePolicy:
    def __init__(self, mode: str, max_skipped: int, optimizer: torch.optim.Optimizer, device: torch.device):
        self.mode, self.max_skipped, self.optimizer = mode, max_skipped, optimizer
        self.on_device = bool(optimizer.defaults.get("fused"))
        self._in_row = torch.zeros((), device=device)
        self._halted = torch.zeros((), device=device)
        self.host_in_row = 0  # the same counter, replayed on the host from what `review` reads
        self.skipped = 0

    def apply(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """Arm the optimizer for this step; returns False when the caller must not call `optimizer.step()`
        (host-checked optimizers only)."""
        bad = (~(torch.isfinite(loss) & torch.isfinite(grad_norm))).float()
        self._in_row = (self._in_row + 1) * bad
        stop_now = bad if self.mode == "stop" else (self._in_row >= self.max_skipped).float()
        self._halted = torch.maximum(self._halted, stop_now)
        found_inf = torch.maximum(bad, self._halted)
        if self.on_device:
            self.optimizer.found_inf = found_inf
            return True
        return not bool(found_inf)  # a host synchronisation: only for optimizers without found_inf

    def review(self, first_step: int, losses: list[float], grad_norms: list[float]) -> list[str]:
        """Replay the policy on steps first_step, first_step+1, ... read back from the device; returns the
        warnings to log, raises TrainingStopped at the step that stopped the run."""
        notes = []
        for step, (loss, gn) in enumerate(zip(losses, grad_norms), start=first_step):
            if math.isfinite(loss) and math.isfinite(gn):
                self.host_in_row = 0
                continue
            what = "loss" if not math.isfinite(loss) else "grad norm"
            if self.mode == "stop":
                raise TrainingStopped(f"non-finite {what} at step {step} (loss={loss}, grad_norm={gn}); no "
                                      "checkpoint was written for it. Lower optimizer.lr or set "
                                      "training.nonfinite=skip")
            self.host_in_row += 1
            self.skipped += 1
            notes.append(f"warning: step {step} skipped (loss={loss}, grad_norm={gn}), {self.host_in_row} in a row")
            if self.host_in_row >= self.max_skipped:
                raise TrainingStopped(f"{self.host_in_row} non-finite steps in a row up to step {step} "
                                      f"(training.max_skipped={self.max_skipped}): stopping")
        return notes
