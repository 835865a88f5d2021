"""Engine replicas on Ray Serve behind a prefix-aware router (`pip install 'pagedllm[ray]'`)."""

from .deployment import build_app

__all__ = ["build_app"]
