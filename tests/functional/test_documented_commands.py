"""Every command the README (```bash fences), the examples (`#   meshforge ...` comment lines) and the docs
(`meshforge plan` commands in docs/*.md fences and inline code, templates with CONFIG-style placeholders left out)
show runs and exits 0, shortened (`training.max_steps=2`, short sequences, few files), in a temporary directory.

How each kind runs, to keep this fast:
- process-free commands (`validate`, `data prepare`) and one-process `train`: in this process, through
  `meshforge.cli.main`, as the console script does;
- `train --nproc-per-node N`: every rank's own command line (what `meshforge train` hands each process it
  starts: the same argv without the flag) runs through `cli.main` inside the suite's shared N-process launch
  (tests/conftest.py GROUP_JOBS); the launcher side is tested by tests/functional/test_under_torchrun.py;
- `verify --nproc-per-node N`: its per-strategy job (`meshforge.verify:run_strategy`, what `verify` runs in
  its own launch) for every registered strategy, in the shared launch;
- `bench --nproc-per-node 2 --sweep distributed.strategy=...`: run by tests/parallel/test_bench_sweep.py
  (the same sweep, more strategies); COVERED_BY names it and the test checks it still does.
Also: each example validates at every world size its comment or the README mentions (tiny_cpu: 1, 2, 4, 8).
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest

from meshforge import cli
from meshforge.config import load_config
from meshforge.config.strategies import strategy_specs
from meshforge.testing.group import Job

ROOT = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("MESHFORGE_TEST_SHARED", "/tmp"))

COVERED_BY = {"bench": ("tests/parallel/test_bench_sweep.py", ["--sweep", "distributed.strategy=ddp,fsdp2,megatron_fsdp",
                                                               '"--nproc-per-node", "2"'])}
SHORT = ["training.max_steps=2", "training.seq_len=32", "logging.log_every=1", "logging.progress=none"]


def _joined(lines: list[str]) -> list[str]:
    out, cur = [], ""
    for ln in lines:
        if ln.rstrip().endswith("\\"):
            cur += ln.rstrip()[:-1].strip() + " "
        else:
            out.append((cur + ln.strip()).strip())
            cur = ""
    return [c for c in out if c]


def readme_commands() -> list[tuple[str, str]]:
    found = []
    for block in re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S):
        for cmd in _joined(block.splitlines()):
            cmd = re.sub(r"\s+#\s.*$", "", cmd).strip()
            if cmd.startswith("pip install"):  # the two set-up lines (CI runs them); keep a `&& meshforge ...` tail
                cmd = cmd.split("&&", 1)[1].strip() if "&&" in cmd else ""
                if not cmd.startswith("meshforge "):
                    continue
            found.append(("README.md", cmd))
    return found


def example_commands() -> list[tuple[str, str]]:
    found = []
    for f in sorted((ROOT / "examples").glob("*.yaml")):
        lines = [ln[1:] for ln in f.read_text().splitlines() if ln.startswith("#")]
        cmds, i = [], 0
        while i < len(lines):
            if lines[i].strip().startswith("meshforge "):
                block = [lines[i]]
                while block[-1].rstrip().endswith("\\") and i + 1 < len(lines):
                    i += 1
                    block.append(lines[i])
                cmds += _joined(block)
            i += 1
        found += [(f"examples/{f.name}", c) for c in cmds]
    return found


def docs_plan_commands() -> list[tuple[str, str]]:
    """`meshforge plan` commands in the docs: fenced lines and inline code spans (spans may wrap lines)."""
    found = []
    for f in sorted((ROOT / "docs").glob("*.md")):
        text = f.read_text()
        spans = [ln for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S) for ln in block.splitlines()]
        spans += re.findall(r"`(meshforge plan [^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
        for cmd in (" ".join(s.split()) for s in spans):
            cmd = re.sub(r"\s+#\s.*$", "", cmd).strip()
            if cmd.startswith("meshforge plan ") and not re.search(r"\b[A-Z][A-Z_]{2,}\b|\[|\.\.\.", cmd):
                found.append((f"docs/{f.name}", cmd))
    return found


COMMANDS = list({c: (w, c) for w, c in reversed(readme_commands() + example_commands() +
                                                 docs_plan_commands())}.values())[::-1]


def _argv(cmd: str) -> list[str]:
    words = shlex.split(cmd)
    assert words[0] == "meshforge", f"a documented command that is not a meshforge command: {cmd}"
    return [str(ROOT / w) if (ROOT / w).exists() and not w.startswith("-") else w for w in words[1:]]


def _nproc(argv: list[str]) -> int:
    for i, w in enumerate(argv):
        if w.startswith("--nproc-per-node"):
            return int(w.split("=", 1)[1] if "=" in w else argv[i + 1])
    return 1


def _without_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for w in argv:
        if skip:
            skip = False
        elif w == "--nproc-per-node":
            skip = True
        elif not w.startswith("--nproc-per-node="):
            out.append(w)
    return out


def shortened_train(argv: list[str], out_dir: Path) -> list[str]:
    """The command's own argv plus the shortening overrides (and few files where it reads text)."""
    argv = _without_nproc(argv)
    extra = ["data.max_files=3"] if "source: text" in Path(argv[1]).read_text() or "data.source=text" in argv else []
    return [*argv, *SHORT, *extra, f"run.output_dir={out_dir}"]


def _id(where: str, cmd: str) -> str:
    return f"{where}: {cmd}"[:110]


# ----------------------------------------------------------------- the shared launches' part
def run_command_job(spec: dict, info) -> int:
    """On every rank of the shared launch: this rank's command line, as `meshforge train` runs it per process."""
    rc = cli.main(spec["argv"])
    assert rc == 0, f"exit {rc}: meshforge {' '.join(spec['argv'])}"
    return rc


GROUP_JOBS, GROUPED = [], {}
for _n, (_where, _cmd) in enumerate(COMMANDS):
    _a = _argv(_cmd)
    _np = _nproc(_a)
    if _a[0] == "train" and _np > 1:
        _name = f"documented-{_n}"
        GROUPED[_cmd] = [_name]
        GROUP_JOBS.append(Job(_name, f"{__file__}:run_command_job",
                              {"argv": shortened_train(_a, SHARED / "documented" / str(_n))}, _np))
    elif _a[0] == "verify":
        GROUPED[_cmd] = []
        for _s in strategy_specs():
            GROUPED[_cmd].append(f"documented-{_n}-{_s}")
            GROUP_JOBS.append(Job(GROUPED[_cmd][-1], "meshforge.verify:run_strategy",
                                  {"strategy": _s, "steps": 2, "out_dir": str(SHARED / "documented" / f"{_n}-{_s}")},
                                  _np))


def test_the_documents_show_commands():
    kinds = {_argv(c)[0] for _, c in COMMANDS}
    assert {"train", "validate", "verify", "data", "bench", "eval", "generate"} <= kinds, kinds
    assert len([c for w, c in COMMANDS if w != "README.md"]) >= 8


def _slow(cmd: str) -> list:
    """Seconds each: the scale trace launches its rank processes, --fit plans hundreds of layouts, eval imports
    lm-eval (and trains the run it reads first)."""
    argv = _argv(cmd)
    return [pytest.mark.slow] if argv[0] == "eval" or {"--trace", "--fit"} & set(argv) else []


@pytest.mark.parametrize("where, cmd", [
    pytest.param(w, c, id=_id(w, c), marks=_slow(c))
    for w, c in COMMANDS if c not in GROUPED])
def test_documented_command_runs(where, cmd, tmp_path, monkeypatch, capsys):
    argv = _argv(cmd)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "examples").symlink_to(ROOT / "examples")  # paths inside the examples are relative to the repo
    if argv[0] in COVERED_BY:
        test_file, needles = COVERED_BY[argv[0]]
        text = (ROOT / test_file).read_text()
        assert all(n in text for n in needles), f"{test_file} no longer runs {cmd}"
        return
    if argv[0] == "data":  # the README's inputs: a docs/ folder of text files, here a small one
        (tmp_path / "docs" / "guide").mkdir(parents=True)
        (tmp_path / "docs" / "guide" / "a.txt").write_text("meshforge trains models.\n" * 50)
    if argv[0] == "train":
        argv = shortened_train(argv, tmp_path / "run")
    if argv[0] in ("eval", "generate"):  # from the run of the example its path names: train that first, shortened
        example = ROOT / "examples" / f"{Path(argv[1]).name}.yaml"
        train = shortened_train(["train", str(example)], tmp_path / argv[1])
        assert cli.main([*train, "checkpoint.save_final=true"]) == 0, capsys.readouterr().err[-3000:]
    if argv[0] == "eval":
        argv = [*argv, "training.seq_len=32", "--limit=4"]
    rc = cli.main(argv)
    err = capsys.readouterr().err
    assert rc == 0, f"{where}: `{cmd}` exited {rc}:\n{err[-3000:]}"
    assert "Traceback" not in err


@pytest.mark.dist
@pytest.mark.parametrize("cmd", list(GROUPED), ids=[c[:100] for c in GROUPED])
def test_documented_multiprocess_command_runs(cmd, group):
    for name in GROUPED[cmd]:
        assert group(name) is not None


def _world_sizes(example: str) -> set[tuple[int, tuple[str, ...]]]:
    """(world size, the command's overrides) of every documented command that names `example`."""
    sizes = set()
    for _, cmd in COMMANDS:
        words = shlex.split(cmd)
        if f"examples/{example}" not in words:
            continue
        over = tuple(w for i, w in enumerate(words) if "=" in w and not w.startswith("-")
                     and not words[i - 1].startswith("--"))  # (not a flag's value: --sweep k=a,b)
        world = 1
        for i, w in enumerate(words):
            if w in ("--nproc-per-node", "--world-size"):
                world = int(words[i + 1])
            elif w.startswith(("--nproc-per-node=", "--world-size=")):
                world = int(w.split("=", 1)[1])
        sizes.add((world, over))
    return sizes | ({(w, ()) for w in (1, 2, 4, 8)} if example == "tiny_cpu.yaml" else set())


@pytest.mark.parametrize("example", sorted(p.name for p in (ROOT / "examples").glob("*.yaml")))
def test_example_validates_at_every_world_size_it_mentions(example):
    for world, over in sorted(_world_sizes(example)):
        load_config(ROOT / "examples" / example, list(over), world_size=world)
