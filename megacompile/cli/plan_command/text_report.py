"""The table ``megacompile plan`` prints (``PlanResult.to_text``), from the ``--json`` object."""
from __future__ import annotations

from megacompile.cli.plan_command.scale_out import format_scale_out
from megacompile.core.units import format_bytes


def _seconds(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s:.3f} s" if s >= 1 else f"{s * 1e3:.1f} ms"


def _per_policy(values: dict) -> str:
    # "; " between policies: "recompute, layer input offloaded" has a comma of its own.
    return "; ".join(f"{p} {format_bytes(n)}" for p, n in values.items())


def format_text(r: dict) -> str:
    m, hw, st, dev, host, tr, tm = (r[key] for key in
                                    ("model", "hardware", "step", "device", "host", "transfers", "time"))
    gib = format_bytes
    ok = lambda flag: "fits" if flag else "DOES NOT FIT"  # noqa: E731
    ext = dev["extrapolation"]
    lines = [
        f"megacompile plan: {m['name'] or m['model_type']} on {hw['name']}, batch {st['batch']} x seq {st['seq_len']} "
        f"= {st['tokens']:,} tokens/step, {st['precision']}",
        f"  model            {m['model_type']}, {m['parameters'] / 1e9:.2f} B parameters, {m['layers']} decoder layers "
        f"(hidden {m['hidden_size']}, MLP {m['intermediate_size']}, vocab {m['vocab_size']})",
        f"  method           traced {ext['traced_layers']} layers "
        + ("on unwritten host weights (fp32 under autocast)" if r["method"]["device"] == "cpu"
           else "on the meta device")
        + " with the megatrain backend "
        f"({len(r['method']['probes'])} plan(s), {r['method']['seconds']['total_s']:.1f} s); layers identical, "
        f"extrapolated to {m['layers']}",
        "",
        f"device memory      {ok(dev['fits'])}",
        f"  plan             {dev['plan']}",
        f"  peak             {gib(dev['peak_bytes'])} of {gib(dev['budget_bytes'])} budget "
        f"({dev['peak_bytes'] / dev['budget_bytes']:.0%})",
        f"  peak at          {dev['peak_at']}",
        *([f"  recompute        {dev['recomputed_layers']} layer(s), each replayed once in its backward (from its "
           f"saved or reloaded input)"] if dev.get("recomputed_layers") else []),
        *([f"  token chunks     each layer's per-token runs (norms, projections, MLP) in {st['token_chunks']} "
           f"chunk(s) of {-(-st['tokens'] // st['token_chunks']):,} tokens: no plan fits with the layers whole"]
          if st.get("token_chunks") else []),
        f"  extrapolation    {ext['traced_layers']}-layer {ext['traced_plan']} plan {gib(ext['traced_peak_bytes'])}; "
        f"saved on the device per layer: "
        + _per_policy(ext["saved_device_bytes_per_layer"]),
        *(["                   on the host per layer: " + _per_policy(ext["saved_host_bytes_per_layer"])]
          if any(ext.get("saved_host_bytes_per_layer", {}).values()) else []),
        f"  keep-all peak    {gib(dev['keep_all_peak_bytes'])}; smallest plan "
        + (gib(dev['smallest_peak_bytes']) if dev['smallest_peak_bytes'] is not None
           else "not planned (keeping everything fits)"),
        "",
        f"host memory        {ok(host['fits'])}",
        f"  total            {gib(host['total_bytes'])} of "
        f"{gib(host['capacity_bytes']) if host['capacity_bytes'] else 'unknown (not checked)'}"
        + (f" ({host['bytes_per_param']} B/param: the optimizer step overlaps the backward)" if host.get("overlapped")
           else f" ({host['bytes_per_param']} B/param; {host['overlapped_bytes_per_param']} B/param when the "
                "optimizer step overlaps the backward)"),
        f"  pinned           {gib(host['pinned_bytes'])}",
        f"  pageable         {gib(host['pageable_bytes'])}",
        "  parts            " + ", ".join(f"{k.replace('_', ' ')} {gib(v)}" for k, v in host["parts_bytes"].items()),
        *([f"  activations      {gib(acts['total_bytes'])} pinned: "
           + "; ".join(f"{n} {p} layer(s) x {gib(acts['per_layer_bytes'][p])}" for p, n in acts["layers"].items())]
          if (acts := host.get("offloaded_activations")) and acts["total_bytes"] else []),
        f"  layout           {host['layout']}",
        "",
        "transfers per step",
        f"  host -> device   {gib(tr['h2d_bytes'])}: parameters forward {gib(tr['h2d']['parameters_forward'])}, "
        f"backward {gib(tr['h2d']['parameters_backward'])}, activations {gib(tr['h2d']['activations'])}",
        f"  device -> host   {gib(tr['d2h_bytes'])}: gradients {gib(tr['d2h']['gradients'])}, "
        f"activations {gib(tr['d2h']['activations'])}",
        "",
        "time per step (cost model)",
        f"  step             {_seconds(tm['step_s'])} (roofline floor {_seconds(tm['roofline_s'])})",
        "  lanes            " + " | ".join(f"{k.replace('_', ' ')} {_seconds(v)}" for k, v in tm["lanes_s"].items())
        + f"  -> bottleneck: {tm['bottleneck'].replace('_', ' ')}",
        f"  host optimizer   {_seconds(tm['host_optimizer_exposed_s'])} after the device work ("
        + ("overlapped with the backward: each gradient's update starts when it lands)"
           if tm["host_optimizer_overlapped"] else "runs after the backward)"),
        f"  throughput       {tm['tokens_per_s']:,.0f} tokens/s, {tm['achieved_tflops']:.1f} TFLOPS, "
        f"MFU {tm['mfu']:.1%}",
    ]
    if r.get("max_seq_len"):
        ms = r["max_seq_len"]
        value = f"{ms['value']:,}" if ms["value"] else "none"
        lines += ["", f"max seq len        {value} at batch {ms['batch']} (grid {ms['grid']}; {ms['how']}; "
                      f"{len(ms['probes'])} probes)" + (f"; {ms['note']}" if ms.get("note") else "")]
    if r.get("scale_out"):
        lines += format_scale_out(r["scale_out"])
    lines.append("")
    if r["fits"]:
        lines.append("verdict            fits")
    else:
        lines.append("verdict            DOES NOT FIT")
        for p in r["problems"]:
            lines.append(f"  - {p['message']}")
        if r["suggestions"]:
            lines.append("  smallest changes that fit:")
            for s in r["suggestions"]:
                lines.append(f"  - {s['message']}")
    return "\n".join(lines)
