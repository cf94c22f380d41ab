import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit


def test_algos_import_no_heavy_frameworks():
    """rlhf_core.algos is pure math: importing it must not pull in any runtime framework."""
    code = (
        "import sys, rlhf_core.algos\n"
        "bad = [m for m in ('ray', 'prefect', 'vllm', 'deepspeed', 'transformers') if m in sys.modules]\n"
        "print(bad); sys.exit(1 if bad else 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
