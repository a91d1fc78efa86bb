"""Run by ``import torch`` itself, through the ``torch.backends`` entry point (pyproject.toml).

It only registers the log name ``megatrain`` with torch's logging system, so that
``TORCH_LOGS="megatrain"`` (or ``"+megatrain"``) is a valid setting: torch 2.13 loads these
entry points before it reads ``TORCH_LOGS`` (earlier releases read it first and reject the
name; there the package's own name works: ``TORCH_LOGS="megacompile"``).

This is a module of its own, outside the ``megacompile`` package, because it runs inside every
``import torch`` and importing the package would import Dynamo there. It makes the same call as
``megacompile.core.torch_compat.register_torch_logs`` (which the package runs when imported,
for environments that skip entry points); it is the one other place a private torch API is
named. It never raises: an error here would fail ``import torch``.
"""

LOG_NAME = "megatrain"
LOGGER = "megacompile"  # every module's logging.getLogger(__name__) is under it


def register_logs() -> None:
    try:
        from torch._logging._internal import register_log  # lazy: torch is still importing this module's caller

        register_log(LOG_NAME, [LOGGER])
    except Exception:  # noqa: BLE001  (a torch without this API: no TORCH_LOGS name, nothing else lost)
        pass
