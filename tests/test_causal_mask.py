"""elide_causal_mask: an attention mask proven causal becomes is_causal=True, and only then.

- Hand-written masks (``ones().tril()``, ``triu(full(-inf), 1)``, arange comparisons,
  ``masked_fill``) are proven causal; sliding windows, offsets, anti-causal masks, masks that
  read a graph input, ``finfo.min`` fills and unequal query / key lengths are kept, with the
  reason. Either way the compiled function returns what eager does. Over a family of
  comparisons ``k op q + c`` and their ``&`` / ``|``, a mask is proven causal exactly when its
  values are ``tril``'s.
- Hugging Face Llama and Qwen2 (the mask ``sdpa_mask`` builds under Dynamo): the mask is proven
  causal, its construction is gone from the programs, ``NodeInfo.attention_mask`` and the
  printed program say so, and training equals eager in fp32 within 1e-5.
- Hugging Face Llama given an ``attention_mask`` input: the mask is kept (its values are not
  known at compile time), and training still equals eager; with the pass switched off
  (``disable_passes``) the mask stays too.
"""
import pytest
import torch
import torch.nn.functional as F
from conftest import COMPILED
from reference_models import train_side_by_side

import megacompile
from megacompile.core.node_info import info
from megacompile.passes import elide_causal_mask

S = 8


def _qkv(q_len=S, kv_len=S, batch=2):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(batch, 2, q_len, 4, generator=gen), torch.randn(batch, 2, kv_len, 4, generator=gen),
            torch.randn(batch, 2, kv_len, 4, generator=gen))


def _compiled_with_this_pass_only(fn, *args):
    """fn compiled with a backend that runs only this pass on Dynamo's graph (after
    canonical_operators, whose one spelling of the operators it uses): (output, the graph)."""
    from megacompile.passes import canonical_operators

    graphs = []

    def backend(gm, _example_inputs):
        canonical_operators.run(gm, None)
        elide_causal_mask.run(gm, None)
        graphs.append(gm)
        return gm.forward

    out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    (gm,) = graphs
    return out, gm


def _run_pass_only(fn, *args):
    """``_compiled_with_this_pass_only``: (output, notes, masks left)."""
    out, gm = _compiled_with_this_pass_only(fn, *args)
    calls = [n for n in gm.graph.nodes if n.target is F.scaled_dot_product_attention]
    notes = [n.meta["custom"][elide_causal_mask.NOTE_KEY] for n in calls]
    masks = [n.kwargs.get("attn_mask") for n in calls]
    return out, notes, masks


def _idx(n=S):
    i = torch.arange(n)
    return i[:, None], i[None, :]  # q (rows), k (columns)


CAUSAL = {
    "ones_tril": lambda: torch.ones(S, S, dtype=torch.bool).tril(),
    "ones_float_tril_to_bool": lambda: torch.ones(S, S).tril() == 1,
    "triu_full_inf": lambda: torch.triu(torch.full((S, S), float("-inf")), 1),
    "arange_le": lambda: (lambda q, k: k <= q)(*_idx()),
    "arange_lt_plus_one": lambda: (lambda q, k: (k < q + 1)[None, None])(*_idx()),
    "not_gt": lambda: (lambda q, k: ~(k > q))(*_idx()),
    "masked_fill": lambda: torch.zeros(S, S).masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf")),
    "where_and_all_true": lambda: torch.where((lambda q, k: (k <= q) & torch.ones(S, S, dtype=torch.bool))(*_idx()),
                                              0.0, float("-inf")),
}

NOT_CAUSAL = {
    "sliding_window": (lambda: (lambda q, k: (k <= q) & (k > q - 3))(*_idx()), "is False where k - q = -7"),
    "offset": (lambda: (lambda q, k: k <= q + 1)(*_idx()), "is True where k = q and True where k = q + 1"),
    "anti_causal": (lambda: (lambda q, k: k >= q)(*_idx()), "is True where k = q and True where k = q + 1"),
    "depends_on_batch": (lambda: (lambda q, k: (k <= q) & (torch.arange(2)[:, None, None, None] == 0))(*_idx()),
                         "depends on b <= 0, not only on k - q"),
    "all_true": (lambda: torch.ones(S, S, dtype=torch.bool), "same everywhere"),
    "finfo_min": (lambda: torch.triu(torch.full((S, S), torch.finfo(torch.float32).min), 1), "where k = q + 1"),
}


@pytest.mark.parametrize("name", sorted(CAUSAL))
def test_causal_masks_are_proven(name):
    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=CAUSAL[name]())

    out, notes, masks = _run_pass_only(fn, *_qkv())
    assert notes[0].startswith("causal:") and masks == [None], notes
    torch.testing.assert_close(out, fn(*_qkv()), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", sorted(NOT_CAUSAL))
def test_other_masks_are_kept_with_the_reason(name):
    make, reason = NOT_CAUSAL[name]

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=make())

    out, notes, masks = _run_pass_only(fn, *_qkv())
    assert notes[0].startswith("kept:") and reason in notes[0] and masks[0] is not None, notes
    torch.testing.assert_close(out, fn(*_qkv()), rtol=1e-6, atol=1e-6)


def test_a_mask_that_reads_an_input_is_kept():
    def fn(q, k, v, pad):
        mask = torch.ones(S, S, dtype=torch.bool).tril() & pad[:, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    pad = torch.ones(2, S, dtype=torch.bool)
    _, notes, masks = _run_pass_only(fn, *_qkv(), pad)
    assert "is an input of the graph" in notes[0] and masks[0] is not None, notes


def test_unequal_lengths_are_kept():
    """is_causal aligns its mask to the top left; a (q, kv) tril with more keys is not that."""
    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(S, S + 2, dtype=torch.bool).tril())

    out, notes, masks = _run_pass_only(fn, *_qkv(S, S + 2))
    assert "queries attend to" in notes[0] and masks[0] is not None, notes
    torch.testing.assert_close(out, fn(*_qkv(S, S + 2)), rtol=1e-6, atol=1e-6)


def _hf(name):
    import transformers as T

    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, use_cache=False, max_position_embeddings=64)
    if name == "qwen2":
        return T.Qwen2ForCausalLM(T.Qwen2Config(**kw))
    return T.LlamaForCausalLM(T.LlamaConfig(**kw))


def _step_of(with_padding_input=False):
    def step_of(model):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(x, y, *mask):
            logits = model(input_ids=x, attention_mask=mask[0] if mask else None).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()
        return step
    return step_of


def _batches(n=2, batch=2, seq=16, padding=False):
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        x, y = (torch.randint(0, 64, (batch, seq), generator=gen) for _ in range(2))
        out.append((x, y, torch.ones(batch, seq, dtype=torch.long)) if padding else (x, y))
    return out


def _attention_ops(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and "scaled_dot_product" in str(n.target)]


def _trains_like_eager_with_the_mask_elided(model, options: dict, note: str = ""):
    """Two AdamW steps of ``model`` (2 attention layers) under megatrain and eagerly, asserted
    equal (fp32: 1e-5), with every attention of both programs causal (its note holding ``note``)
    and nothing (tokens x tokens) built: no bool tensor, no compare of indices. The record."""
    pairs, reference = train_side_by_side(model, _step_of(), _batches(), options)
    for got, want in pairs:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    for (pname, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5, msg=lambda m: f"{pname}: {m}")
    record = next(r for r in COMPILED if r.backward is not None)
    for gm in (record.forward, record.backward):
        ops = _attention_ops(gm)
        notes = [info(n).attention_mask for n in ops]
        assert len(ops) == 2 and all(n.startswith("causal:") and note in n for n in notes), notes
        assert all(n.args[4] is True and n.kwargs.get("attn_mask") is None for n in ops if "backward" not in
                   str(n.target))
        for n in gm.graph.nodes:
            val = n.meta.get("val")
            assert not (isinstance(val, torch.Tensor) and val.dtype == torch.bool), n.format_node()
    return record


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_hf_mask_is_elided_and_training_equals_eager(name):
    torch.manual_seed(0)
    record = _trains_like_eager_with_the_mask_elided(_hf(name), {"snapshots": True})
    forward = next(s.text for s in record.snapshots if s.graph == "forward" and s.stage == "annotate")
    assert "attention mask causal:" in forward


def test_hf_padding_input_keeps_the_mask():
    torch.manual_seed(0)
    model = _hf("llama")
    pairs, _ = train_side_by_side(model, _step_of(True), _batches(n=1, padding=True), {})
    for got, want in pairs:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    record = next(r for r in COMPILED if r.backward is not None)
    ops = _attention_ops(record.forward)
    assert ops and all(info(n).attention_mask.startswith("kept:") and "input of the graph" in info(n).attention_mask
                       for n in ops), [info(n).attention_mask for n in ops]
    assert all(n.kwargs.get("attn_mask") is not None for n in ops)


def test_marked_layers_have_their_mask_elided_inside_the_region_and_train_like_eager():
    """Layers marked with ``nested_compile_region`` (``mark_repeated_layers``) get the mask the step
    builds as an input of their one traced body: proven causal there at every call, the body
    attends with is_causal=True, the input is dropped from the body and its calls, and nothing
    (tokens x tokens) is built any more."""
    torch.manual_seed(0)
    model = _hf("llama")
    assert megacompile.mark_repeated_layers(model) == ["model.layers.0", "model.layers.1"]
    _trains_like_eager_with_the_mask_elided(model, {}, note="inside the layer region")


def _region_pass_only(second):
    """Two calls of one marked attention body, the first passed the causal mask and the second
    ``second``; only canonical_operators and this pass run. (outputs, the eager outputs, the
    body's attention node)."""
    from megacompile.core import torch_compat as compat

    @torch.compiler.nested_compile_region
    def attend(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def fn(q, k, v):
        q_i, k_i = _idx()
        return attend(attend(q, k, v, k_i <= q_i), k, v, second(q_i, k_i))

    out, gm = _compiled_with_this_pass_only(fn, *_qkv())
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and compat.is_invoke_subgraph(n.target)]
    assert len(calls) == 2 and len({c.args[0].target for c in calls}) == 1
    body = getattr(gm, calls[0].args[0].target)
    (attention,) = [n for n in body.graph.nodes if n.target is F.scaled_dot_product_attention]
    return out, fn(*_qkv()), attention, calls


def test_a_region_mask_causal_at_every_call_is_elided_and_dropped_from_its_calls():
    out, want, attention, calls = _region_pass_only(lambda q, k: (k < q + 1))
    assert attention.meta["custom"][elide_causal_mask.NOTE_KEY].startswith("causal:")
    assert attention.kwargs.get("attn_mask") is None and attention.kwargs.get("is_causal") is True
    assert all(len(c.args) == 2 + 3 for c in calls)  # q, k, v: the mask input is gone
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)


def test_a_region_mask_causal_at_one_call_only_is_kept_naming_the_other():
    out, want, attention, calls = _region_pass_only(lambda q, k: (k <= q) & (k > q - 3))
    note = attention.meta["custom"][elide_causal_mask.NOTE_KEY]
    assert note.startswith("kept:") and "is False where k - q = -7" in note, note
    assert attention.kwargs.get("attn_mask") is not None and all(len(c.args) == 2 + 4 for c in calls)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)


def test_a_region_also_called_inside_another_region_is_left_as_it_is():
    """One marked body called in the step with the causal mask and inside another region with a
    window: Dynamo keeps one body object for every call, under two attribute names, and reads it
    from the other region's body too. Its calls are gathered by the object, not the name, and a
    body another body reads is left alone: the mask stays, the calls keep their inputs (grouped by
    name, the body was rewritten for the causal calls and the window's call crashed: one input
    too many)."""
    from megacompile.core import torch_compat as compat

    @torch.compiler.nested_compile_region
    def attend(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    @torch.compiler.nested_compile_region
    def outer(q, k, v, mask):
        return attend(q, k, v, mask) * 2

    def fn(q, k, v):
        q_i, k_i = _idx()
        return attend(q, k, v, k_i <= q_i) + outer(q, k, v, (k_i <= q_i) & (k_i > q_i - 3))

    out, gm = _compiled_with_this_pass_only(fn, *_qkv())
    torch.testing.assert_close(out, fn(*_qkv()), rtol=1e-6, atol=1e-6)
    inner_calls = [n for _, m in gm.named_modules() if m is not gm and isinstance(m, torch.fx.GraphModule)
                   for n in m.graph.nodes if n.op == "call_function" and compat.is_invoke_subgraph(n.target)]
    assert inner_calls, "the test needs a region called inside another"
    attentions = [n for _, m in gm.named_modules() if isinstance(m, torch.fx.GraphModule)
                  for n in m.graph.nodes if n.target is F.scaled_dot_product_attention]
    assert attentions and all(n.kwargs.get("attn_mask") is not None for n in attentions)


def test_every_small_comparison_is_judged_by_its_values():
    """Soundness over a family of masks: ``k op q + c`` alone and and-ed / or-ed with a second
    comparison, all in one graph. A mask is proven causal exactly when its values are tril's."""
    ops = {"le": torch.le, "lt": torch.lt, "ge": torch.ge, "gt": torch.gt}
    family = [((a, c),) for a in ops for c in (-1, 0, 1)]
    family += [((a, c), (b, d), join) for a, c, b, d, join in [
        ("le", 0, "ge", -S, "and"), ("le", 0, "gt", -3, "and"), ("lt", 1, "le", 0, "and"), ("le", 0, "lt", 0, "or"),
        ("le", -1, "ge", 0, "and"), ("lt", 0, "le", 0, "or"), ("le", 0, "ge", S, "or")]]

    def build(q, k, spec):
        (a, c), *rest = spec
        mask = ops[a](k, q + c)
        if rest:
            (b, d), join = rest
            other = ops[b](k, q + d)
            mask = mask & other if join == "and" else mask | other
        return mask

    def fn(q, k, v):
        i = torch.arange(S)
        return [F.scaled_dot_product_attention(q, k, v, attn_mask=build(i[:, None], i[None, :], spec))
                for spec in family]

    _, notes, _ = _run_pass_only(fn, *_qkv())
    tril = torch.ones(S, S, dtype=torch.bool).tril()
    i = torch.arange(S)
    for spec, note in zip(family, notes):
        causal = torch.equal(build(i[:, None], i[None, :], spec), tril)
        assert note.startswith("causal:") == causal, (spec, note)


def test_switched_off_the_mask_stays():
    torch.manual_seed(0)
    pairs, _ = train_side_by_side(_hf("llama"), _step_of(), _batches(n=1), {"disable_passes": ["elide_causal_mask"]})
    torch.testing.assert_close(pairs[0][0], pairs[0][1], rtol=1e-5, atol=0)
    record = next(r for r in COMPILED if r.backward is not None)
    ops = _attention_ops(record.forward)
    assert ops and all(info(n).attention_mask is None and n.kwargs.get("attn_mask") is not None for n in ops)


def test_arguments_in_an_unexpected_spelling_are_kept():
    """masked_fill's value as a keyword: not a rule's spelling, so the mask is kept (no crash)."""
    def fn(q, k, v):
        tril = torch.ones(S, S, dtype=torch.bool).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.zeros(S, S).masked_fill(~tril, value=-1e9))

    out, notes, masks = _run_pass_only(fn, *_qkv())
    assert notes[0].startswith("kept:") and "not understood" in notes[0] and masks[0] is not None, notes
    torch.testing.assert_close(out, fn(*_qkv()), rtol=1e-6, atol=1e-6)


def _as_dunder_methods(gm) -> int:
    """Respells every ``call_function operator.X`` on a tensor as ``call_method __X__`` (``__rX__``
    with the operands swapped where the tensor is second), as torch 2.11's Dynamo records them."""
    from megacompile.passes.canonical_operators import METHODS

    spelling = {(fn, swapped): name for name, (fn, _, swapped) in METHODS.items()}
    respelled = 0
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.kwargs or not isinstance(n.meta.get("example_value"), torch.Tensor):
            continue
        first_is_node = bool(n.args) and isinstance(n.args[0], torch.fx.Node)
        name = spelling.get((n.target, not first_is_node))
        if name is None:
            continue
        n.op, n.target = "call_method", name
        if not first_is_node:
            n.args = (n.args[1], n.args[0])
        respelled += 1
    gm.recompile()
    return respelled


def test_hf_mask_spelled_as_torch_2_11_traces_it_is_elided_after_canonical_operators():
    """torch 2.11's Dynamo records ``a == b`` as ``call_method __eq__`` (seen on the H100 machine:
    the mask was kept, "eq (call_method __eq__) is not understood"). The same graph respelled so:
    the mask interpreter alone keeps the mask; canonical_operators first, and it is proven causal,
    and the respelled and canonical graphs compute what Dynamo's graph does."""
    from megacompile.passes import canonical_operators

    torch.manual_seed(0)
    model = _hf("llama").eval()
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    outcomes = {}

    def backend(gm, example_inputs):
        want = gm(*example_inputs)
        respelled = _as_dunder_methods(gm)
        assert respelled >= 3, respelled  # the mask's comparisons and logic at least
        torch.testing.assert_close(gm(*example_inputs), want, rtol=0, atol=0)
        import copy
        alone = copy.deepcopy(gm)
        elide_causal_mask.run(alone, None)
        outcomes["alone"] = [n.meta["custom"][elide_causal_mask.NOTE_KEY] for n in _attention_ops(alone)]
        canonical_operators.run(gm, None)
        assert not any(n.op == "call_method" and n.target in canonical_operators.METHODS for n in gm.graph.nodes)
        elide_causal_mask.run(gm, None)
        outcomes["canonical"] = [n.meta["custom"][elide_causal_mask.NOTE_KEY] for n in _attention_ops(gm)]
        torch.testing.assert_close(gm(*example_inputs), want, rtol=1e-6, atol=1e-6)  # is_causal=True: same attention
        return gm.forward

    with torch.no_grad():
        torch.compile(lambda t: model(input_ids=t).logits, backend=backend, fullgraph=True)(x)
    assert len(outcomes["alone"]) == 2 and all(n.startswith("kept:") and "call_method __" in n
                                               for n in outcomes["alone"]), outcomes["alone"]
    assert len(outcomes["canonical"]) == 2 and all(n.startswith("causal:") for n in outcomes["canonical"])


def test_canonical_operators_swaps_the_operands_of_reflected_methods():
    from megacompile.passes import canonical_operators

    graph = torch.fx.Graph()
    a = graph.placeholder("a")
    graph.output(graph.call_method("__rsub__", (a, 1.0)))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    t = torch.tensor([3.0, 5.0])
    assert torch.equal(gm(t), 1.0 - t)
    canonical_operators.run(gm, None)
    (node,) = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert node.args == (1.0, a) and torch.equal(gm(t), 1.0 - t)
