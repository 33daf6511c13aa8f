"""The GPU lane (benchmarks/gpu_check.sh, docs/gpu.md) runs end to end in its --dry-run mode:
the same steps on the CPU, the CUDA tests through Triton's interpreter, one quick benchmark."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.sh"


def _lane(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable)
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          timeout=300)


@pytest.mark.slow
def test_dry_run_end_to_end(tmp_path):
    out = tmp_path / "lane"
    proc = _lane("--dry-run", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["device"] == "cpu"
    assert [s["step"] for s in summary["steps"]] == ["info", "tests", "bench-losses"]
    assert all(s["status"] == "ok" for s in summary["steps"]), summary
    # The CUDA tests ran on the CPU (not all skipped), and none failed.
    suite = ET.parse(out / "tests.xml").getroot().find("testsuite")
    ran = int(suite.get("tests")) - int(suite.get("skipped"))
    assert ran >= 5 and suite.get("failures") == "0" and suite.get("errors") == "0"
    bench = json.loads((out / "bench-losses.json").read_text())
    assert bench["rows"] and {r["bench"] for r in bench["rows"]} == {"losses"}


def test_bad_arguments_are_refused(tmp_path):
    for args in ([], ["--fast", str(tmp_path)], [str(tmp_path), str(tmp_path / "b")]):
        proc = _lane(*args)
        assert proc.returncode == 2 and "usage:" in proc.stderr, args
