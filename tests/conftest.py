import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
import pytest  # noqa: E402


@pytest.fixture
def tmp_run(tmp_path):
    """Overrides that send a run's outputs into a temporary directory."""
    return [f"run.output_dir={tmp_path / 'run'}"]
