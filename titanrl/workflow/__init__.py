"""The RL step as a declared workflow (DistFlow): node definitions (``graph``: what), an executor every rank
runs (``executor``: when), and the data between nodes (``executor.DataBuffer``: where)."""
