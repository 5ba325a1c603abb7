"""benchmarks/master_step.py's inputs and its like-for-like column (the timings themselves are not tested)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "master_step.py"


def test_fewer_than_ten_million_parameters_are_refused_with_the_reason() -> None:
    # a model that fits in the caches would time the caches, not memory: the target is for >= 10M
    run = subprocess.run([sys.executable, str(SCRIPT), "--params", "2e6"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2  # argparse's usage error
    assert "--params 2e+06: at least 10e6" in run.stderr and "caches" in run.stderr


def test_scaled_rows_are_compared_with_torchs_fused_step_behind_torchs_scaler() -> None:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import master_step
    finally:
        sys.path.remove(str(SCRIPT.parent))
    assert master_step._unscaled("torch AdamW(fused=True), fp32 params")
    assert master_step._unscaled("MasterWeights(AdamW, master_grads=False, compile_step=True), no scaler")
    assert not master_step._unscaled("torch AdamW(fused=True), fp32 params + torch GradScaler")
    assert not master_step._unscaled("MasterWeights(AdamW, flat=True) + GradScaler")
