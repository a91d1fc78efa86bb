"""Mark repeated layers the user did not mark, so that torch.compile traces each kind once.

A transformer's decoder layers are one module class applied N times to parameters of the same
shapes. Marked with ``torch.compiler.nested_compile_region``, Dynamo traces the layer's body
once and calls it per layer, and AOTAutograd partitions it once (megatrain then inlines the
calls, megacompile/capture/inline_regions.py): compile time grows at about half the rate per layer
(benchmarks/compile_time.py, table (c)). Most users do not mark their layers, and the classes
come from libraries (transformers), so this module finds them:

* a repeat is a run of two or more children of one ``nn.ModuleList`` / ``nn.Sequential`` with
  the same class and the same parameter and buffer names, shapes and dtypes;
* each child's class becomes a subclass made once per class, whose ``forward`` is the class's
  forward wrapped as a region: the class itself (and every other model using it) is left as it
  was, ``isinstance`` still holds, and ``unmark_repeated_layers`` puts the class back.
  (A region-wrapped function set as an instance attribute instead looks the same but is not:
  on torch 2.13, in a net of 9 blocks, Dynamo inlined block 0 and ran blocks 1-8 all with
  block 1's parameters, so the loss was wrong; tests/test_template_planner.py trips on it.)

What a region requires is the user's to keep: the layer's forward must not mutate module
state or depend on Python-side state that changes from call to call (Hugging Face decoder
layers qualify; a layer that caches on ``self`` does not).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from megacompile.core import torch_compat as compat

# The attribute of a marking subclass that names the class it was made from.
_MARK = "_megacompile_repeat_region_of"
# One marking subclass per layer class, made once (a region is one traced body per function).
_MARKED_CLASSES: dict[type, type] = {}


# --- the call, flattened ------------------------------------------------------------------------
# At every call of a region Dynamo fingerprints the arguments to find the traced body it can
# reuse. Flat positional leaves (tensors, constants, the module) take its fast path; anything
# else, keyword arguments included, is flattened by tracing ``pytree.tree_flatten`` through
# Dynamo, which was half of Dynamo's time per decoder layer (a Hugging Face layer is called
# with keywords and a (cos, sin) tuple): 0.10 s per layer on 2 cores (benchmarks/compile_time.py
# --breakdown, table (h)). So the marking
# forward flattens the call itself, into a layout string (one constant) and the leaves, and the
# region rebuilds the call from them.
_LEAF = (torch.Tensor, type(None), bool, int, float, str)


def _flatten_call(args: tuple, kwargs: dict) -> tuple[str, list] | None:
    """(layout, leaves) of a call whose arguments are leaves or flat tuples / lists of leaves;
    None for any other argument (a cache object, a dict)."""
    parts, leaves = [], []
    if not all(name.isidentifier() for name in kwargs):  # the layout spells keywords as names
        return None
    for name, value in list(enumerate(args)) + list(kwargs.items()):
        if isinstance(value, _LEAF):
            parts.append(str(name))
            leaves.append(value)
        elif type(value) in (tuple, list) and all(isinstance(v, _LEAF) for v in value):
            parts.append(f"{name}:{type(value).__name__}:{len(value)}")
            leaves.extend(value)
        else:
            return None
    return "|".join(parts), leaves


def _unflatten_call(layout: str, leaves: tuple) -> tuple[list, dict]:
    """The inverse of ``_flatten_call``: positional names are digits, keywords are not."""
    args, kwargs, k = [], {}, 0
    for part in layout.split("|") if layout else ():
        name, *sequence = part.split(":")
        if sequence:
            kind, count = sequence[0], int(sequence[1])
            value = tuple(leaves[k:k + count]) if kind == "tuple" else list(leaves[k:k + count])
            k += count
        else:
            value = leaves[k]
            k += 1
        if name.isdigit():
            args.append(value)
        else:
            kwargs[name] = value
    return args, kwargs


def _marked_class(cls: type) -> type:
    if cls not in _MARKED_CLASSES:
        body = cls.forward

        def flat_body(self, layout: str, *leaves):
            args, kwargs = _unflatten_call(layout, leaves)
            return body(self, *args, **kwargs)

        flat_region = torch.compiler.nested_compile_region(flat_body)
        region = torch.compiler.nested_compile_region(body)

        def forward(self, *args, **kwargs):
            flat = _flatten_call(args, kwargs)
            if flat is None:
                return region(self, *args, **kwargs)
            return flat_region(self, flat[0], *flat[1])

        forward.__doc__ = body.__doc__
        _MARKED_CLASSES[cls] = type(cls.__name__, (cls,), {
            "forward": forward, _MARK: cls, "__module__": cls.__module__, "__qualname__": cls.__qualname__,
        })
    return _MARKED_CLASSES[cls]


def _signature(module: nn.Module) -> tuple:
    tensors = list(module.named_parameters()) + list(module.named_buffers())
    return (type(module), tuple((name, tuple(t.shape), t.dtype) for name, t in tensors))


def find_repeats(model: nn.Module) -> list[list[str]]:
    """Module paths of each run of repeated layers (two or more, consecutive, in one container)."""
    runs: list[list[str]] = []
    for path, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        run: list[str] = []
        previous = None
        for name, child in container.named_children():
            signature = _signature(child)
            if signature != previous and len(run) >= 2:
                runs.append(run)
            if signature != previous:
                run = []
            if any(True for _ in child.parameters()):  # a parameterless module is not a layer
                run.append(f"{path}.{name}" if path else name)
            previous = signature
        if len(run) >= 2:
            runs.append(run)
    return runs


def mark_repeated_layers(model: nn.Module) -> list[str]:
    """Wrap the forward of every repeated layer with ``torch.compiler.nested_compile_region``
    (one region per class) before ``torch.compile``; returns the module paths marked.

    Layers whose class's forward is marked already, or whose instance has its own forward,
    are left alone."""
    marked: list[str] = []
    for run in find_repeats(model):
        for path in run:
            layer = model.get_submodule(path)
            cls = type(layer)
            if "forward" in vars(layer) or _MARK in vars(cls) or compat.is_compile_region(cls.forward):
                continue
            layer.__class__ = _marked_class(cls)
            marked.append(path)
    return marked


def unmark_repeated_layers(model: nn.Module) -> list[str]:
    """Undo ``mark_repeated_layers``: the layers' class forward applies again."""
    unmarked = []
    for path, module in model.named_modules():
        original = vars(type(module)).get(_MARK)
        if original is not None:
            module.__class__ = original
            unmarked.append(path)
    return unmarked
