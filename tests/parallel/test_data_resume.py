"""Resume after a world-size change (2 -> 1) for real data, with background workers and a streaming source.

In the shared N=2 launch each config trains 2 steps under fsdp2 and saves; here, at N=1, the run resumes from
that checkpoint and trains steps 3-4. Its losses must equal an uninterrupted single-process run of 4 steps
(relative 1e-5: the N=2 steps reduce in another order), which holds only if the loader continues with exactly
global batch 3 at the new world size (a skipped or repeated batch changes the loss by far more).
- sft: packed prompt/completion examples (3-tuples with document ids), data.num_workers=2 at N=2 and 0 at N=1
  (the worker count may change on resume: the step is the position);
- stream: data.streaming over the same jsonl's prompts as text, one worker tokenizing ahead at N=2, none at N=1;
- mix: data.mix of the packed examples, a stream of the completions and synthetic tokens (weights 3:2:1), one
  worker at N=2, none at N=1 (the schedule and every source's position continue exactly).
"""

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from meshforge.testing.group import Job
from meshforge.testing.parity import config, single_info

pytestmark = pytest.mark.dist

DATA = Path(__file__).resolve().parents[2] / "examples" / "data" / "prompt_completion_tiny.jsonl"
SOURCES = {
    "sft": ["data.source=dataset", f"data.paths=[{DATA}]", "data.format=prompt_completion", "data.packing=true"],
    "stream": ["data.source=dataset", f"data.paths=[{DATA}]", "data.text_field=prompt", "data.streaming=true"],
    "mix": ["data.source=text",  # (the base run's synthetic source, back to the default data.mix replaces)
            f"data.mix=[{{source: dataset, paths: [{DATA}], format: prompt_completion, packing: true, weight: 3}}, "
            f"{{source: dataset, paths: [{DATA}], text_field: completion, streaming: true, weight: 2}}, "
            "{source: synthetic, weight: 1}]"],
}
WORKERS_N2 = {"sft": ["data.num_workers=2"], "stream": ["data.num_workers=1"], "mix": ["data.num_workers=1"]}
OUT = Path(tempfile.gettempdir()) / f"meshforge-data-resume-{os.getpid()}"
RTOL = 1e-5


def save_at_two(spec, info) -> dict:
    from meshforge.training.trainer import train

    out = {}
    for name, overrides in SOURCES.items():
        res = train(config(overrides + WORKERS_N2[name] + ["training.micro_batch_size=2", "checkpoint.interval=2",
                                                           f"run.output_dir={spec}/{name}"], 2, info.world_size), info)
        out[name] = res.losses
    return out


GROUP_JOBS = [Job("data resume n2", f"{Path(__file__).resolve()}:save_at_two", str(OUT), 2,
                  prepare=lambda: OUT.mkdir(parents=True, exist_ok=True))]


@pytest.mark.parametrize("name", list(SOURCES))
def test_resume_from_two_processes_on_one(group, name, tmp_path):
    from meshforge.training.trainer import train

    at_two = group("data resume n2")[name]
    ref = train(config(SOURCES[name], 4, world_size=1), single_info())
    resumed = train(config(SOURCES[name] + [f"run.output_dir={tmp_path}",
                                            f"checkpoint.resume={OUT / name / 'checkpoints' / 'step_2'}"], 4,
                           world_size=1), single_info())
    assert resumed.start_step == 2
    got = at_two + resumed.losses
    rel = max(abs(a - b) / abs(a) for a, b in zip(ref.losses, got))
    print(f"{name}: 2 steps at N=2 + 2 resumed at N=1 vs 4 at N=1: max rel loss diff {rel:.2e}")
    assert len(got) == 4 and rel < RTOL, f"{name}: {got} vs uninterrupted {ref.losses}"
    if name == list(SOURCES)[-1]:
        shutil.rmtree(OUT, ignore_errors=True)
