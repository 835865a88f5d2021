"""What a worker does differently on a CUDA device: the CUDA backends' platform face
(platform.py), and one job a module behind it: the default dtype (dtype.py), the KV pool sized
by profiling a forward pass (memory.py), page-locked swap space (pinning.py) and decode steps
replayed from CUDA graphs (graphs.py)."""
