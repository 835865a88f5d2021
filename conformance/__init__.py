"""The conformance suite every backend must pass."""
