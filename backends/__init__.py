"""Backends: registry, worker, runner, models, sampler and each backend's attention ops."""
