"""A run's report, rebuilt from its run directory with this checkout's code, as a PNG (real Chromium).

What a GPU session brings back is the run directory (metrics, attempts, startup phases, restarts, GPU
readings); the images under docs/images/ are drawn from it here, so a report fixed since shows the
same run the way the pipeline now reports it. The run directory is copied first: it is not changed.

    .venv/bin/python bench/report_png.py RUN_DIR docs/images/NAME.png [--width 1100] [--until Plots]

Needs Chromium (Debian's ``chromium``, or ``CHROMIUM=/path``) and the project's Playwright.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any


def chromium() -> str:
    """``$CHROMIUM``, else the ``chromium`` on PATH."""
    path = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        raise SystemExit("Chromium not found: apt-get install -y chromium, or set CHROMIUM=/path/to/it")
    return path


def render(run_dir: Path, out: Path, *, width: int, until: str | None = None) -> Path:
    """Rebuild the report of a copy of ``run_dir`` and write its page to ``out``: the whole page, or the part
    above the section headed ``until``."""
    from playwright.sync_api import sync_playwright

    from verl_pipeline.report.write import write_report

    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / run_dir.name
        shutil.copytree(run_dir, copy)
        files = write_report(copy)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
            try:
                page = browser.new_page(viewport={"width": width, "height": 900})
                page.goto(files.html.resolve().as_uri())
                page.wait_for_load_state("load")
                out.parent.mkdir(parents=True, exist_ok=True)
                clip: Any = None  # playwright's Clip: x, y, width, height
                if until:
                    heading = page.get_by_role("heading", name=until, exact=True)
                    box = heading.first.bounding_box() if heading.count() else None
                    if box is None:
                        raise SystemExit(f"the report has no section headed {until!r}")
                    clip = {"x": 0, "y": 0, "width": width, "height": box["y"]}
                page.screenshot(path=str(out), full_page=True, clip=clip)
            finally:
                browser.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--width", type=int, default=1100, help="the page's width in pixels")
    p.add_argument("--until", help="stop above the section with this heading (e.g. Plots)")
    args = p.parse_args(argv)
    print(render(args.run_dir, args.out, width=args.width, until=args.until))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
