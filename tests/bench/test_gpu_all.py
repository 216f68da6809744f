"""bench/gpu_all.sh on the CPU, with a stand-in Python that logs each call: which scenarios and helpers
a launch runs, in which order, with which arguments, and what its progress file says."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _sh(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(REPO / "bench" / "gpu_all.sh"), *args], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=60)


def test_a_launch_says_when_it_started_and_when_it_ended(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # No scenario wanted: the launch is over at once, and its progress says so however it ended.
    done = _sh(str(out), str(tmp_path / "work"), env={"ONLY": "none"})
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(r"\d\d:\d\d:\d\d start\n\d\d:\d\d:\d\d end\n", (out / "progress").read_text())


def test_the_rollout_ceiling_runs_on_the_newest_0_5b_run(tmp_path: Path) -> None:
    """ROLLOUT_CEILING=1 hands bench/rollout_ceiling.py the last 0.5B run's directory (the repeated run's
    when there are two). A stand-in Python records each call instead of running it."""
    out, work = tmp_path / "out", tmp_path / "work"
    calls = tmp_path / "calls"
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    python.chmod(0o755)
    older, newer = (work / "real-size" / name / "home" / "runs" / "r" for name in ("real-size", "real-size-2"))
    for i, run in enumerate((older, newer)):
        run.mkdir(parents=True)
        os.utime(run, (1_000_000 + i, 1_000_000 + i))
    done = _sh(str(out), str(work), env={"ONLY": "real-size", "NO_BARE": "1",
                                                       "ROLLOUT_CEILING": "1", "PYTHON": str(python)})
    assert done.returncode == 0, done.stderr
    ceiling = [c for c in calls.read_text().splitlines() if "rollout_ceiling.py" in c]
    assert ceiling == [f"{REPO}/bench/rollout_ceiling.py --run-dir {newer}/ --out {out}/rollout-ceiling.json"]
    progress = (out / "progress").read_text()
    assert "rollout-ceiling rc=0" in progress
    assert re.search(r"real-size rc=0, disk free [0-9.]+[KMGT]\n", progress), progress  # what a launch has left


def test_the_gpu_busy_recording_spans_the_0_5b_runs_and_is_analysed_after(tmp_path: Path) -> None:
    """The driver's samples are recorded while the 0.5B scenario runs, watching its DAG runs' and its bare
    twin's metrics, then analysed; GPU_BUSY=0 leaves both out. A stand-in Python logs each call."""
    out, work, calls, python = tmp_path / "out", tmp_path / "work", tmp_path / "calls", tmp_path / "python"
    python.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    python.chmod(0o755)
    env = {"ONLY": "real-size", "PYTHON": str(python)}
    assert _sh(str(out), str(work), env=env).returncode == 0
    made = [c.split()[0].rsplit("/", 1)[-1] + " " + c.split()[1] for c in calls.read_text().splitlines()
            if "gpu_busy.py" in c or "gpu_acceptance.py --steps" in c]
    # The recorder goes to the background as the scenario starts (either may log first); the analysis
    # follows both.
    assert sorted(made[:2]) == ["gpu_acceptance.py --steps", "gpu_busy.py record"]
    assert made[2:] == ["gpu_busy.py analyse"]
    record = next(c for c in calls.read_text().splitlines() if "gpu_busy.py record" in c)
    assert f"--metrics {work}/real-size/*/home/runs/*/metrics-a*.jsonl" in record
    assert f"--metrics {work}/real-size/bare/metrics.jsonl --out {out}/gpu-busy.jsonl" in record
    assert "gpu-busy rc=0" in (out / "progress").read_text()
    calls.unlink()
    assert _sh(str(out), str(work), env={**env, "GPU_BUSY": "0"}).returncode == 0
    assert "gpu_busy.py" not in calls.read_text()


def test_the_gpu_stacks_shared_libraries_are_read_once_before_the_0_5b_runs(tmp_path: Path) -> None:
    """Both runs of the pair start on a warm page cache (the first one on a fresh machine would read the
    libraries from disk alone): the stack's .so files, torch's site and verl's, are read and counted."""
    import sys

    out, work, calls, python = tmp_path / "out", tmp_path / "work", tmp_path / "calls", tmp_path / "python"
    site, verl_site = tmp_path / "torch-site", tmp_path / "verl-site"
    for pkg, size in ((site / "torch" / "lib" / "libtorch_cuda.so", 2_000_000),
                      (site / "nvidia" / "cublas" / "lib" / "libcublas.so.13", 1_000_000),
                      (verl_site / "verl" / "__init__.py", 10), (verl_site / "vllm" / "_C.abi3.so", 2_000_000)):
        pkg.parent.mkdir(parents=True, exist_ok=True)
        pkg.write_bytes(b"x" * size)
    (site / "torch" / "__init__.py").write_text("")
    # The stand-in runs the launch's own look-ups (python -c … find_spec …) and logs every other call.
    python.write_text(f'#!/bin/sh\ncase "$2" in *find_spec*) exec {sys.executable} "$@";; esac\necho "$@" >> {calls}\n')
    python.chmod(0o755)
    env = {"ONLY": "real-size", "PYTHON": str(python), "NO_BARE": "1", "GPU_BUSY": "0",
           "PYTHONPATH": f"{site}{os.pathsep}{verl_site}"}
    assert _sh(str(out), str(work), env=env).returncode == 0
    assert re.search(r"\d\d:\d\d:\d\d read 5 MB of shared libraries in \d+ s\n", (out / "progress").read_text())
    (out / "progress").unlink()
    assert _sh(str(out), str(work), env={**env, "PAGE_CACHE": "0"}).returncode == 0
    assert "shared libraries" not in (out / "progress").read_text()


def test_tiny_twin_gives_the_ppo_and_resume_scenarios_their_bare_verl_twins_and_no_other(tmp_path: Path) -> None:
    out, work, calls, python = tmp_path / "out", tmp_path / "work", tmp_path / "calls", tmp_path / "python"
    python.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    python.chmod(0o755)
    env = {"ONLY": "acceptance ppo resume-ppo", "PYTHON": str(python), "TINY_TWIN": "1"}
    assert _sh(str(out), str(work), env=env).returncode == 0
    runs = {c.split("--scenario ")[1].split()[0]: c for c in calls.read_text().splitlines() if "--scenario" in c}
    assert set(runs) == {"acceptance", "ppo", "resume-ppo"}
    assert runs["ppo"].endswith(" --twin") and runs["resume-ppo"].endswith(" --twin")
    assert "--twin" not in runs["acceptance"]
    assert "MB of shared libraries" in (out / "progress").read_text()  # the pair starts on a warm page cache
