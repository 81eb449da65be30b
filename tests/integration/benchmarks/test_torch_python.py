"""The benchmarks' PyTorch baseline: where no torch imports, the drivers skip its rows; an
explicit ``--torch-python`` that cannot import torch is refused at the command line. The
driver code only (no timed worker), so that a helper renamed under one script fails here, in
the README's test command, and not first in CI's ``benchmarks/quick.sh``."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
# each script's arguments that ask for the PyTorch baseline and write nothing
SCRIPTS = {"fednas_search.py": ["--no-write"], "api_memory.py": ["--variants", "torch"], "gpu.py": ["--no-write"],
           "jax_versions.py": ["--no-write"]}


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_torch_python_without_torch_is_refused(script, tmp_path):
    proc = _run(script, "--quick", *SCRIPTS[script], "--out", str(tmp_path / "r.md"),
                "--torch-python", sys.executable + "-does-not-exist")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "--torch-python" in proc.stderr and "cannot import torch" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "r.md").exists()


def test_gpu_script_skips_the_torch_part_where_torch_is_missing():
    has_torch = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True).returncode == 0
    if has_torch:
        pytest.skip("torch imports here: the skip path is not reachable")
    proc = _run("gpu.py", "--quick", "--no-write", "--parts", "torch")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "torch: skipped: torch is not installed" in proc.stdout, proc.stdout[-2000:]
