"""The README's two set-up commands exist, and CI runs exactly the test one."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def fenced_bash_lines():
    text = (ROOT / "README.md").read_text()
    setup = text.split("## Set up", 1)[1].split("\n## ", 1)[0]
    return [ln.strip() for b in re.findall(r"```bash\n(.*?)```", setup, re.S) for ln in b.splitlines() if ln.strip()]


def test_exactly_two_setup_commands():
    lines = fenced_bash_lines()
    assert len(lines) == 2
    train, test = lines
    assert "pip install" in train and "meshforge train examples/tiny_cpu.yaml" in train
    assert "pip install" in test and "[test]" in test and "pytest" in test


def test_ci_runs_the_readme_test_command():
    out = subprocess.run([sys.executable, str(ROOT / ".ci" / "readme_test_command.py")], capture_output=True,
                         text=True, check=True).stdout.strip()
    assert out == fenced_bash_lines()[1]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "readme_test_command.py" in ci and "no tests ran" in ci
