"""Start-up hook of bench/serving/timeline.py (read it first): with ``DECONV_TIMELINE_DIR`` set, the process that
imports ``service.engine.local`` records its batches' timeline. Put this folder on ``PYTHONPATH`` only for a
measurement; without the variable it does nothing."""

from __future__ import annotations

import os

if os.environ.get("DECONV_TIMELINE_DIR"):
    import importlib.abc
    import importlib.util
    import sys
    from pathlib import Path
    from types import ModuleType
    from typing import Any

    class _AfterEngineImport(importlib.abc.MetaPathFinder):
        """Finds ``service.engine.local`` as Python would and installs the recording right after it runs."""

        def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
            if name != "service.engine.local":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            if spec is None or spec.loader is None:
                return spec
            run = spec.loader.exec_module

            def exec_module(module: ModuleType) -> None:
                run(module)
                source = Path(__file__).resolve().parents[1] / "timeline.py"
                timeline_spec = importlib.util.spec_from_file_location("deconv_bench_timeline", source)
                assert timeline_spec is not None
                assert timeline_spec.loader is not None
                timeline = importlib.util.module_from_spec(timeline_spec)
                sys.modules[timeline_spec.name] = timeline
                timeline_spec.loader.exec_module(timeline)
                timeline.install_from_env()

            spec.loader.exec_module = exec_module  # type: ignore[method-assign]
            return spec

    sys.meta_path.insert(0, _AfterEngineImport())
