"""Small training steps compiled once per test session, their graphs kept for pass unit tests.

Each fixture compiles one reference model's training step with megatrain on the CPU stand-in
and keeps, from that one real compile: Dynamo's graph as the backend received it (before the
dynamo-stage passes), the joint forward+backward graph as AOTAutograd handed it to the
partitioner (before any joint-stage pass), the input names and roles, the forward's output
count, the options, and the record of the plan that was chosen (``CompiledGraph``). The graphs
are taken by wrapping the backend's entry points for the duration of that compile.

The passes rewrite graphs and their node meta in place, so a test never touches the kept
graphs: ``fresh_dynamo_graph`` / ``fresh_joint_graph`` / ``fresh_record`` give it copies
that share no node, meta dict or ``NodeInfo`` with them.
"""
from __future__ import annotations

import copy
import dataclasses
import warnings
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from reference_models import GPT, MLP, _token_batch, _xent

from megacompile import backend
from megacompile.capture import training_compiler
from megacompile.capture.records import CompiledGraph, recording
from megacompile.core.node_info import NodeInfo
from megacompile.options import Options
from megacompile.passes import PassContext
from megacompile.plan.training_plan import TrainingPlan

STAND_IN = {"device": "cpu", "lowering": "eager"}


def independent_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose nodes, meta dicts and ``NodeInfo`` are its own (fake tensors,
    module stacks' entries and other values nobody rewrites in place stay shared)."""
    with warnings.catch_warnings():
        # Copying the joint graph's pytree code generator copies its TreeSpecs, which makes
        # torch warn about its own deprecated LeafSpec check; nothing of ours is involved.
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        graph = copy.deepcopy(gm.graph)
    for old, new in zip(gm.graph.nodes, graph.nodes):
        assert old.name == new.name, (old.name, new.name)
        new.meta = {key: copy.copy(value) if isinstance(value, (dict, list, NodeInfo)) else value
                    for key, value in old.meta.items()}
    copied = fx.GraphModule(gm, graph)
    copied.meta = dict(gm.meta)
    return copied


@dataclasses.dataclass
class CapturedStep:
    """One compiled training step's graphs and what the compiler knew about them."""

    name: str
    model: nn.Module
    # Dynamo's graph inputs, in order (the model's parameters and the batch): real tensors,
    # to run a rewritten Dynamo graph against the graph as captured.
    example_inputs: list
    dynamo_graph: fx.GraphModule
    joint_graph: fx.GraphModule
    input_names: list[str]
    input_roles: list[str]
    num_fwd_outputs: int
    options: Options
    record: CompiledGraph

    def fresh_dynamo_graph(self) -> fx.GraphModule:
        return independent_copy(self.dynamo_graph)

    def fresh_joint_graph(self) -> fx.GraphModule:
        return independent_copy(self.joint_graph)

    def fresh_record(self) -> CompiledGraph:
        """The chosen plan's record with its own copies of the rewritten programs and plan."""
        return dataclasses.replace(self.record, forward=independent_copy(self.record.forward),
                                   backward=independent_copy(self.record.backward),
                                   plan=copy.deepcopy(self.record.plan), snapshots=list(self.record.snapshots))

    def options_with(self, **changes: Any) -> Options:
        return dataclasses.replace(self.options, **changes)

    def context(self, stage: str, plan: TrainingPlan | None = None, options: Options | None = None) -> PassContext:
        """A pass context for ``stage`` as the compiler makes it (the forward's user outputs
        are AOTAutograd's forward outputs)."""
        return PassContext(options or self.options, stage, plan if plan is not None else TrainingPlan(),
                           list(self.input_names), list(self.input_roles),
                           num_user_outputs=self.num_fwd_outputs if stage == "forward" else 0)


def capture_step(name: str, model: nn.Module, batch: tuple, loss_fn, **options: Any) -> CapturedStep:
    """Compiles ``loss_fn(model(x), y); loss.backward()`` once with megatrain on the CPU
    stand-in (plus ``options``), runs it on ``batch``, and keeps its graphs."""
    calls: list[dict] = []
    compile_training = backend._compile_training
    partition = training_compiler.TrainingCompiler.partition

    def capturing_compile_training(gm, example_inputs, opts, names, roles):
        calls.append(dict(dynamo=independent_copy(gm), example_inputs=list(example_inputs), options=opts,
                          names=list(names), roles=list(roles)))
        return compile_training(gm, example_inputs, opts, names, roles)

    def capturing_partition(self, joint, joint_inputs, *, num_fwd_outputs, **kw):
        # A nested_compile_region body's own joint graph comes with no inputs; the step's does.
        if not (isinstance(joint_inputs, (list, tuple)) and len(joint_inputs) == 0):
            calls[-1].update(joint=independent_copy(joint), num_fwd_outputs=num_fwd_outputs, compiler=self)
        return partition(self, joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kw)

    def step(x, y):
        loss = loss_fn(model(x), y)
        loss.backward()
        return loss

    with pytest.MonkeyPatch.context() as patch, recording() as records:
        patch.setattr(backend, "_compile_training", capturing_compile_training)
        patch.setattr(training_compiler.TrainingCompiler, "partition", capturing_partition)
        torch._dynamo.reset()
        torch.compile(step, backend="megatrain", options={**STAND_IN, **options})(*batch)
    torch._dynamo.reset()
    (training,) = [c for c in calls if "joint" in c]
    record = training["compiler"].record
    assert record in records and record.backward is not None, [r.label for r in records]
    return CapturedStep(name, model, training["example_inputs"], training["dynamo"], training["joint"],
                        training["names"], training["roles"], training["num_fwd_outputs"], training["options"],
                        record)


def _mlp_step(**options: Any) -> CapturedStep:
    torch.manual_seed(0)
    model = MLP(width=16, depth=2, out=4)
    return capture_step("mlp", model, (torch.randn(4, 16), torch.randn(4, 4)), F.mse_loss, **options)


def _hf_llama(layers: int = 2):
    """A tiny Hugging Face Llama with its default (sdpa) attention: under Dynamo it builds the
    causal mask as a tensor, which ``elide_causal_mask`` proves causal."""
    import transformers  # (here: only the Llama capture needs it, and it is slow to import)

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=96, num_hidden_layers=layers,
                                      num_attention_heads=2, num_key_value_heads=1, use_cache=False,
                                      max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config)


class _Logits(nn.Module):
    """A causal LM's logits from its token ids (what the step's loss reads)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=idx).logits


@pytest.fixture(scope="session")
def captured_mlp() -> CapturedStep:
    """A 2-layer MLP in fp32 with every parameter streamed (no resident parameters)."""
    with torch.random.fork_rng(devices=[]):
        return _mlp_step(disable_passes=["resident_parameters"])


@pytest.fixture(scope="session")
def captured_mlp_bf16() -> CapturedStep:
    """The same MLP under ``precision="bf16"``: autocast's casts in the joint graph."""
    with torch.random.fork_rng(devices=[]):
        return _mlp_step(precision="bf16", disable_passes=["resident_parameters"])


@pytest.fixture(scope="session")
def captured_gpt() -> CapturedStep:
    """The reference GPT (2 blocks) with its LM head fused over chunks of 8 of its 32 tokens."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = GPT(layers=2)
        batch = _token_batch(torch.Generator().manual_seed(0))
        return capture_step("gpt", model, batch, _xent, head_chunk_tokens=8)


@pytest.fixture(scope="session")
def captured_llama() -> CapturedStep:
    """A 2-layer Hugging Face Llama (sdpa attention, its causal mask built as a tensor)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = _Logits(_hf_llama())
        batch = _token_batch(torch.Generator().manual_seed(0), vocab=64)
        return capture_step("llama", model, batch, _xent)
