"""The version the package, the CLI and the HTTP server report (pyproject.toml holds the same)."""

VERSION = "0.1.0"
