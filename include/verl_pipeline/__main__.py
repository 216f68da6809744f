from __future__ import annotations

from verl_pipeline.cli import main

raise SystemExit(main())
