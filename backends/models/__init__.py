"""Model code shared by every backend: configs, layers, loader."""
