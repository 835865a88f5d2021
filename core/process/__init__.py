"""The engine core's process plumbing: the loop, the workers it starts and talks to, sockets and
shared memory. See docs/architecture.md."""
