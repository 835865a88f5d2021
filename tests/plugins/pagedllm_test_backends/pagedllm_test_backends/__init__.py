"""Backends that live outside pagedllm and reach it through the `pagedllm.backends` entry points."""
