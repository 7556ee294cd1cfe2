"""Helpers for the tests of bench/'s scripts; those that drive a server take theirs from tests/service/conftest.py."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from ..service.conftest import REPO_ROOT


def bench_module(name: str) -> ModuleType:
    """A script of bench/ (``bench/<name>.py``, not a package) loaded as the module ``bench_<name>``."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO_ROOT / "bench" / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
