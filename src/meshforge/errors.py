"""Every error meshforge reports to a user, in one leaf module (it imports nothing from meshforge).

Each carries `problems`: one line per problem, naming what is wrong and how to fix it. The CLI prints each
line as `error: <line>` and exits with the class's `exit_code` (2: bad input; 3: a run that stopped itself),
never with a traceback. Layers raise these without importing each other.
"""

from __future__ import annotations


class MeshforgeError(Exception):
    """Base: one or more one-line problems."""

    exit_code = 2

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else [str(p) for p in problems]
        super().__init__("\n".join(self.problems))


class ConfigError(MeshforgeError):
    """A config (YAML, overrides, or attribute edits) that breaks the schema or a cross-field rule."""


class LayoutError(ConfigError):
    """Sizes that do not multiply out to the world size."""


class PipelinePlanError(ConfigError):
    """A pipeline split, schedule or microbatch count that cannot work."""


class DataError(MeshforgeError, ValueError):
    """Bad data input (missing files, wrong dtype, too short)."""


class CheckpointError(MeshforgeError):
    """A checkpoint that cannot be used (missing, truncated, from another model)."""


class BenchError(MeshforgeError, ValueError):
    """Bad bench input (sweep, world sizes, flags)."""


class CalibrationError(MeshforgeError):
    """A run directory or efficiency file `meshforge plan --calibrate/--efficiency` cannot use."""


class TrainingStopped(MeshforgeError, RuntimeError):
    """A run that ended early for a reason the user must see (non-finite loss or grad norm)."""

    exit_code = 3
