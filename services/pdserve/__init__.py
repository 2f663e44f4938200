"""pdserve: an LLM inference cluster that gives prefill and decode their own GPU pools."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("pdserve")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+local"
