"""The import-cost bench on the CPU: a module that takes a known time to import is timed and named."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.bench import bench_script

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "import_cost.py"
SLEEP_S = 0.4


def _bench() -> Any:
    return bench_script("import_cost")


def test_a_slow_import_is_timed_in_a_fresh_process_and_named_and_a_missing_module_fails(tmp_path: Path) -> None:
    (tmp_path / "slow_to_import.py").write_text(f"import time\ntime.sleep({SLEEP_S})\nimport json\n")
    out = tmp_path / "cost.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--module", "slow_to_import", "--module", "no_such_module",
                           "--repeat", "2", "--out", str(out)], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(tmp_path), "PATH": ""})
    assert done.returncode == 1, done.stderr  # one module failed
    costs = json.loads(out.read_text())["costs"]
    assert [(c["module"], c["repeat"], c["ok"]) for c in costs] == [
        ("slow_to_import", 1, True), ("no_such_module", 1, False), ("slow_to_import", 2, True),
        ("no_such_module", 2, False)]
    slow = costs[2]
    assert slow["wall_s"] >= SLEEP_S
    assert slow["top_self_s"][0][0] == "slow_to_import" and slow["top_self_s"][0][1] >= SLEEP_S
    assert slow["top_cumulative_s"][0][0] == "slow_to_import"
    assert costs[1]["error"] == "ModuleNotFoundError: No module named 'no_such_module'"
    assert "slow_to_import: " in done.stdout and "slow_to_import, longest: slow_to_import " in done.stdout


def test_importtimes_nesting_gives_the_outer_levels_cumulative_times() -> None:
    stderr = "\n".join([
        "import time: self [us] | cumulative | imported package",
        "import time:       100 |        100 |   encodings.aliases",
        "import time:       200 |        300 | encodings",
        "import time:      5000 |       5000 |     vllm.deep",
        "import time:      1000 |       6000 |   vllm.config",
        "import time:       500 |       6500 | vllm",
        "some warning printed by a module"])
    own, outer = _bench().parse_importtime(stderr)
    assert own[0] == ("vllm.deep", 0.005) and len(own) == 5
    assert outer == [("vllm", 0.0065), ("vllm.config", 0.006), ("encodings", 0.0003), ("encodings.aliases", 0.0001)]
