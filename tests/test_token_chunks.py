"""Token-chunked layers: the pass, the op, parity with eager, the planner's chunk count, memory.

- The pass (``chunk_tokens``) finds the runs of per-token ops of each layer, by what the ops
  are: a hand-written Llama-like block and Hugging Face Llama both get two runs per layer (norm
  + projections before attention; output projection, residual, norm, MLP after it), attention
  stays whole; ``NodeInfo.token_chunks`` and ``inspect`` say so.
- Training with the runs chunked equals eager: fp32 within 1e-5 (hand-written and HF Llama,
  GPT-2's Conv1D MLP), bf16 within tests/test_bf16.py's stock tolerance.
- Option "auto": a step that fits is compiled unchanged; one that fits only chunked gets the
  fewest chunks whose plan fits, chosen by the planner.
- The op's planned working set is what the CPU stand-in measures (within 5%).
- A user's bad value for the option is refused with the valid ones.
"""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import COMPILED
from reference_models import train_side_by_side
from test_bf16 import STOCK_LOSS_RTOL

import megacompile
from megacompile.core import ops, token_chunks
from megacompile.core.errors import BudgetError, OptionsError
from megacompile.core.node_info import info
from megacompile.options import parse_options
from megacompile.plan import flat_planner
from megacompile.plan.flat_planner import some_plan_fits


class _RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(dim))

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(x.dtype)


class _Block(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.norm1, self.norm2 = _RMSNorm(dim), _RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.gate, self.up = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, 2, d // 2).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + self.out(a)
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class _Model(nn.Module):
    def __init__(self, vocab=64, dim=32, hidden=128, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(_Block(dim, hidden) for _ in range(layers))
        self.norm = _RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def _hf(name):
    import transformers as T

    if name == "gpt2":
        return T.GPT2LMHeadModel(T.GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=64, vocab_size=64,
                                              resid_pdrop=0, embd_pdrop=0, attn_pdrop=0))
    return T.LlamaForCausalLM(T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=96, num_hidden_layers=2,
                                            num_attention_heads=2, num_key_value_heads=1, use_cache=False,
                                            max_position_embeddings=64))


def _loss(model, x, y):
    out = model(input_ids=x) if not isinstance(model, _Model) else model(x)
    logits = getattr(out, "logits", out)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def _step_of(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(x, y):
        loss = _loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    return step


def _batches(n=2, batch=2, seq=16, vocab=64):
    gen = torch.Generator().manual_seed(1)
    return [tuple(torch.randint(0, vocab, (batch, seq), generator=gen) for _ in range(2)) for _ in range(n)]


def _train(model, options, batches, autocast=False):
    return train_side_by_side(model, _step_of, batches, options, autocast)


def _chunked_nodes():
    record = next(r for r in COMPILED if r.backward is not None)
    fwd = [n for n in record.forward.graph.nodes if n.target is token_chunks.FORWARD]
    bwd = [n for n in record.backward.graph.nodes if n.target is token_chunks.BACKWARD]
    return fwd, bwd


@pytest.mark.parametrize("name", ["hand-written", "hf-llama", "hf-gpt2", "hf-llama-marked"])
def test_fp32_parity_with_runs_chunked(name):
    """Losses and parameters equal eager within 1e-5 over two AdamW steps, every run in 4
    chunks of the 32 tokens; each layer has its runs before and after attention (GPT-2: its
    Conv1D MLP after attention). Marked layers (``mark_repeated_layers``) too: their runs are in
    the regions' bodies, which the pass sees once the calls are inlined."""
    torch.manual_seed(0)
    model = _Model() if name == "hand-written" else _hf(name[3:].removesuffix("-marked"))
    if name.endswith("-marked"):
        megacompile.mark_repeated_layers(model)
    pairs, reference = _train(model, {"token_chunks": 4}, _batches())
    fwd, bwd = _chunked_nodes()
    decoder = [n for n in fwd if info(n).layer.split(".")[-1].isdigit()]  # (a final norm is a run of its own)
    # (GPT-2's LayerNorm + qkv projection holds less than it reads and writes: left whole)
    assert len({info(n).layer for n in decoder}) == 2 and len(decoder) == (2 if name == "hf-gpt2" else 4)
    assert len(bwd) == len(fwd)
    assert all(n.args[token_chunks.CHUNKS_ARG] == 4 for n in fwd + bwd)
    assert all("over 4 chunks of 8 of 32 tokens" in info(n).token_chunks for n in fwd + bwd)
    for got, want in pairs:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    for (pname, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5, msg=lambda m: f"{pname}: {m}")
    if name == "hand-written":
        _check_hand_written_runs(decoder)


def _trains_like_eager_in_two_chunks(model):
    pairs, reference = _train(model, {"token_chunks": 2}, _batches())
    assert _chunked_nodes()[1]
    for got, want in pairs:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5)


def test_frozen_weights_in_a_chunked_run():
    """Frozen weights (a LoRA-style fine-tune: the base model frozen, only the norms train) leave
    several of a chunked run's gradients unneeded; each is its own empty tensor, since a custom
    op's returns may not alias one another (one shared empty failed every backward)."""
    torch.manual_seed(0)
    model = _Model()
    for name, p in model.named_parameters():
        p.requires_grad_("norm" in name)
    _trains_like_eager_in_two_chunks(model)


class _ScaledMixerBlock(_Block):
    """A run (norm, projection) scaled by a ``(1, 1, C)`` multiplier (Falcon-H1's muP vector)
    before an op that mixes tokens: inside the chunk, which sees the tokens as rows ``(n, C)``,
    broadcasting gives the run's output a leading 1, ``(1, n, C)``."""

    def __init__(self, dim, hidden):
        super().__init__(dim, hidden)
        self.register_buffer("multiplier", 1 + 0.1 * torch.randn(1, 1, hidden))

    def forward(self, x):
        h = self.up(self.norm1(x)) * self.multiplier
        h = torch.cumsum(h, dim=1) * 0.1
        return x + self.down(F.silu(h))


def test_a_run_output_with_a_leading_one_gets_its_gradient_in_its_shape():
    """The chunked backward gave such an output its gradient in rows ``(n, C)``: autograd refused
    ("Mismatch in shape") and the step failed to compile (Falcon-H1 under a tight budget, where
    "auto" chunks)."""
    torch.manual_seed(0)
    model = _Model()
    model.layers = nn.ModuleList(_ScaledMixerBlock(32, 128) for _ in range(2))
    _trains_like_eager_in_two_chunks(model)


def _check_hand_written_runs(decoder):
    """Before attention: the norm and the qkv projection; after it: the output projection, the
    residual add, the norm, the gated MLP and the last residual add. Attention stays outside."""
    before, after = [token_chunks.body_of(n.args[0]).ops for n in decoder if info(n).layer == "layers.0"]
    assert "rsqrt" in before and before.count("linear") == 1
    assert after.count("linear") == 4 and "silu" in after and after.count("rsqrt") == 1
    assert "scaled_dot_product_attention" not in before + after


@pytest.mark.parametrize("name", ["hand-written", "hf-llama"])
def test_bf16_losses_within_the_stock_tolerance(name):
    """bf16 (the runs traced under autocast inside the op) against eager autocast: losses
    within 2^-12 relative, the tolerance tests/test_bf16.py documents."""
    torch.manual_seed(0)
    model = _Model() if name == "hand-written" else _hf("llama")
    pairs, _ = _train(model, {"token_chunks": 4, "precision": "bf16"}, _batches(n=1 if name == "hf-llama" else 2),
                      autocast=True)
    assert _chunked_nodes()[0]
    for got, want in pairs:
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=STOCK_LOSS_RTOL, atol=0)
    # Every weight's load belongs to its parameter's layer, the bf16 copies of a chunked run's
    # weights too (their casts are traced outside any module): the layer is what prefetch, the
    # merged runs and the plan command's per-layer numbers go by.
    record = next(r for r in COMPILED if r.backward is not None)
    loads = [n for g in (record.forward, record.backward) for n in g.graph.nodes if n.target is ops.load]
    weights = [(n, n.args[0] if n.args[0].op == "placeholder" else n.args[0].args[0]) for n in loads]
    weights = [(n, p) for n, p in weights if p.op == "placeholder" and info(p).role == "param"]
    assert any(p is not n.args[0] for n, p in weights)  # bf16 copies among them
    assert all(info(n).layer == info(p).layer for n, p in weights), [
        (n.name, info(n).layer, info(p).layer) for n, p in weights if info(n).layer != info(p).layer]


def _wide(seq=128):
    torch.manual_seed(0)
    model = _Model(vocab=32, dim=16, hidden=256, layers=1)
    x = torch.randint(0, 32, (1, seq), generator=torch.Generator().manual_seed(1))
    return model, (x, x)


def _compile_and_run(model, batch, options):
    COMPILED.clear()
    step = torch.compile(_step_of(model), backend="megatrain",
                         options={"device": "cpu", "lowering": "eager", "disable_passes": ["fuse_lm_head"],
                                  **options})
    step(*batch)
    return megacompile.last_report()


def test_auto_leaves_a_fitting_step_alone_and_chunks_one_that_only_fits_chunked(monkeypatch):
    """"auto": a step that fits is compiled unchanged; one that fits only chunked gets the
    fewest chunks that fit. With the runs chunked, a chunk's replay and backward set the
    backward's peak: the planned peak (the op's working set from its traced chunk programs)
    is the measured one. The counts the search probes with a few builds
    (``flat_planner.some_plan_fits``) give the plan the whole ladder at every count gives."""
    probed = []

    def probe(*args):
        probed.append(some_plan_fits(*args))
        return probed[-1]

    monkeypatch.setattr(flat_planner, "some_plan_fits", probe)
    model, batch = _wide()
    _compile_and_run(copy.deepcopy(model), batch, {"memory_budget": "1GiB"})
    assert _chunked_nodes() == ([], [])
    with pytest.raises(BudgetError) as error:  # nothing fits: the layers-whole minimum, and chunking's lower one
        _compile_and_run(copy.deepcopy(model), batch, {"memory_budget": 1})
    whole, lower = error.value.minimum_budget, error.value.token_chunked_minimum
    assert lower is not None and lower < whole and str(lower) in str(error.value)
    budget = (whole + lower) // 2
    report = _compile_and_run(copy.deepcopy(model), batch, {"memory_budget": budget})
    fwd, bwd = _chunked_nodes()
    count = fwd[0].args[token_chunks.CHUNKS_ARG]
    assert count > 1 and all(n.args[token_chunks.CHUNKS_ARG] == count for n in fwd + bwd)
    planned, measured = report.planned_peak_device_bytes, report.measured_peak_device_bytes
    assert planned <= budget and max(info(n).workspace_bytes for n in bwd) > 0.2 * planned
    assert abs(measured - planned) <= 0.05 * planned
    with pytest.raises(BudgetError):  # the fewest: half as many chunks do not fit
        _compile_and_run(copy.deepcopy(model), batch, {"memory_budget": budget, "token_chunks": count // 2})

    assert True in probed  # some count was settled by the probe alone
    monkeypatch.setattr(flat_planner, "some_plan_fits", lambda *args: False)
    torch._dynamo.reset()
    unprobed = _compile_and_run(copy.deepcopy(model), batch, {"memory_budget": budget})
    assert _chunked_nodes()[0][0].args[token_chunks.CHUNKS_ARG] == count
    assert (unprobed.planned_peak_device_bytes, unprobed.policy) == (planned, report.policy)


def test_auto_chunks_the_runs_of_marked_layers():
    """Where only chunked plans fit, "auto" traces again with the runs chunked: those of marked
    layers too, which are in their regions' bodies until inlined."""
    torch.manual_seed(0)
    model = _Model(vocab=32, dim=16, hidden=256, layers=2)
    megacompile.mark_repeated_layers(model)
    x = torch.randint(0, 32, (1, 128), generator=torch.Generator().manual_seed(1))
    with pytest.raises(BudgetError) as error:
        _compile_and_run(copy.deepcopy(model), (x, x), {"memory_budget": 1})
    whole, lower = error.value.minimum_budget, error.value.token_chunked_minimum
    assert lower is not None and lower < whole
    torch._dynamo.reset()
    reference = copy.deepcopy(model)
    report = _compile_and_run(model, (x, x), {"memory_budget": (whole + lower) // 2})
    fwd, bwd = _chunked_nodes()
    assert {info(n).layer for n in fwd} >= {"layers.0", "layers.1"} and len(bwd) == len(fwd)
    assert report.measured_peak_device_bytes <= (whole + lower) // 2
    for p, q in zip(model.parameters(), reference.parameters()):
        assert not torch.equal(p, q)  # it trained
    _step_of(reference)(x, x)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5)


def test_token_chunks_option_is_checked():
    for bad in (0, -1, True, "many", 2.5):
        with pytest.raises(OptionsError, match="token_chunks"):
            parse_options({"device": "cpu", "token_chunks": bad})
    assert parse_options({"device": "cpu", "token_chunks": 8}).token_chunks == 8


def test_a_failure_to_chunk_leaves_the_unchunked_budget_error(monkeypatch):
    """Chunking is the backend's second try where nothing fits whole: if it fails for a reason of
    its own, the user gets the first try's ``BudgetError`` and a warning naming the failure,
    not an internal error."""
    import megacompile.backend as backend

    whole = backend._compile_training
    tries = []

    def failing_when_chunked(gm, example_inputs, opts, names, roles):
        tries.append(opts.token_chunks)
        if len(tries) > 1:
            raise RuntimeError("chunk trace failed")
        return whole(gm, example_inputs, opts, names, roles)

    monkeypatch.setattr(backend, "_compile_training", failing_when_chunked)
    torch.manual_seed(0)
    model = _Model()
    with pytest.warns(UserWarning, match="chunking this graph's per-token runs failed .RuntimeError: chunk trace"):
        with pytest.raises(BudgetError) as excinfo:
            torch.compile(_step_of(model), backend="megatrain",
                          options={"device": "cpu", "lowering": "eager", "memory_budget": 1024})(*_batches(1)[0])
    assert len(tries) == 2 and excinfo.value.minimum_budget > 1024


def test_a_run_backward_called_with_inputs_that_require_grad_is_not_zeros():
    """Where the backward op gets a weight that requires grad with grad mode on (Wav2Vec2's
    chunked encoder layers did), torch.library runs its kernel below autograd: the slice's
    replay recorded nothing and every gradient it returned was zero (the step trained with
    50-100% wrong weight gradients, no error). The replay turns autograd's dispatch back on;
    a replay that records nothing raises instead of returning zeros."""
    import torch.fx as fx  # lazy: only this test builds a run by hand

    def run(tokens, weight, bias):
        return (torch.nn.functional.layer_norm(torch.nn.functional.linear(tokens, weight, bias).relu(), (16,)),)

    body = token_chunks.register_body(token_chunks.ChunkBody(
        graph=fx.symbolic_trace(run), num_token_inputs=1, out_lead=[(2, 6)], autocast=None, ops=["linear"]))
    g = torch.Generator().manual_seed(0)
    tokens, weight = torch.randn(2, 6, 8, generator=g), torch.randn(16, 8, generator=g)
    bias = torch.randn(16, generator=g)
    grad_out = torch.randn(2, 6, 16, generator=g)
    inputs = [t.clone().requires_grad_() for t in (tokens, weight, bias)]
    want = torch.autograd.grad(run(*inputs)[0], inputs, grad_out)
    with torch.enable_grad():
        got = torch.ops.megatrain.token_chunked_backward(
            body, 3, [tokens], [weight.clone().requires_grad_(), bias], [grad_out], [True, True, True])
    for w, got_one in zip(want, got):
        torch.testing.assert_close(got_one.view(w.shape), w, rtol=1e-5, atol=1e-6)
