"""The spec's smoke tests the spec's way: pytest inside 2 processes started by torch's launcher,

    torchrun --nproc_per_node=2 -m pytest tests/functional/test_fsdp2.py -v

here for every functional module at once (one launch). Each rank writes a JUnit report; every test of every
module must have passed (not skipped) on both ranks.
"""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from meshforge.launch import launch

HERE = Path(__file__).resolve().parent
MODULES = ["test_fsdp2.py", "test_megatron_fsdp.py"]
EXPECTED = {"test_fsdp2.py": {"test_bring_your_own_model", "test_fsdp2_pretrain_basic"},
            "test_megatron_fsdp.py": {"test_fsdp_pretrain_basic", "test_fsdp2_interchange"}}


def run_pytest(spec: dict) -> dict:
    """Launch target: pytest in this rank (as `torchrun -m pytest` runs it); {test: outcome} from its report."""
    import pytest as _pytest

    report = Path(spec["reports"]) / f"rank{os.environ['RANK']}.xml"
    code = _pytest.main([*spec["files"], "-q", "-p", "no:cacheprovider", "-o", "addopts=", f"--junitxml={report}"])
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        outcomes[f"{case.get('classname', '').rpartition('.')[2]}.py::{case.get('name')}"] = kind
    return {"exit_code": int(code), "outcomes": outcomes}


@pytest.mark.dist
@pytest.mark.slow
def test_functional_modules_pass_under_torchrun(tmp_path):
    spec = {"files": [str(HERE / m) for m in MODULES], "reports": str(tmp_path)}
    res = launch(f"{Path(__file__).resolve()}:run_pytest", spec, nproc=2, timeout=600, cwd=HERE.parents[1])
    assert res.error is None, f"{res.error}\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
    want = {f"{m}::{t}" for m, tests in EXPECTED.items() for t in tests}
    for rank, r in enumerate(res.ranks):
        assert r["exit_code"] == 0, (rank, r, res.stdout[-4000:])
        passed = {t for t, kind in r["outcomes"].items() if kind == "passed"}
        assert want <= passed, f"rank {rank}: not passed: {sorted(want - passed)} ({r['outcomes']})"
