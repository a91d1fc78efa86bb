"""The optimizer on the host: the fused Adam/AdamW step, and its overlap with the backward.

- ``host_step``: stock Adam/AdamW run by the fused host kernel; ``step()`` out of the trace.
- ``overlap``: when the update may overlap the backward (bytecode check), the gradient lander.
- ``eager_update_watch``: one warning when an optimizer ran outside megatrain.
"""
