"""The scheduling brain: which tokens of which requests run in each step, and in which KV blocks;
the features that change a step (speculation, structured outputs) as components it calls.
Torch-free, socket-free: it is tested in-process with a fake worker. See docs/architecture.md."""
