"""The installed package's version (one source of truth: client/pyproject.toml)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("deconv-client")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"
