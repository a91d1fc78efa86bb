"""The shared core every stage builds on: the program's IR and the few utilities all use.

- ``ops``: the ``megatrain`` op library (load, offload, wait, evict) the passes insert.
- ``node_info``: ``NodeInfo``, what the passes know about each node (layer, role, placement,
  bytes, provenance, decision and reason).
- ``printer``: the program as text (``megacompile inspect``, golden files).
- ``errors``: the errors users see; ``units``: byte counts as people write them.
- ``torch_compat``: every private PyTorch API megacompile touches, in one module.
- ``collector``: Python's cycle collector paused while a compile runs.

Nothing here imports any other part of megacompile (tests/test_layout.py checks it).
"""
