"""Print the README's test command: the one fenced bash line that runs pytest."""
import re
import sys
from pathlib import Path

readme = Path(__file__).resolve().parent.parent / "README.md"
blocks = re.findall(r"```bash\n(.*?)```", readme.read_text(), re.S)
lines = [ln.strip() for b in blocks for ln in b.splitlines() if "pytest" in ln]
if len(lines) != 1:
    sys.exit(f"README.md must hold exactly one pytest command in a bash block, found {len(lines)}")
print(lines[0])
