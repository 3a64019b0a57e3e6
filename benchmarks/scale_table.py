"""The table of benchmarks/scale.py's results: every run of a row on both sides, ratios of medians, and the
figures issue 30's "Done when" reads (what checkpointing cut, memory growth per generated token). Stdlib only."""

from __future__ import annotations

import json
from pathlib import Path


def last_update(r: dict) -> dict | None:
    return r["updates"][-1] if r.get("updates") else None


def fmt_runs(values: list, spec: str) -> str:
    return " / ".join("-" if v is None else format(v, spec) for v in values) if values else "-"


def median(values: list):
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    n = len(values)
    return values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2


def side_cells(runs: list[dict]) -> tuple[str, str, str]:
    ok = [r for r in runs if "failed" not in r]
    failed = [r["failed"] for r in runs if "failed" in r]
    rss = fmt_runs([r["peak_rss_mib"] / 1024 for r in ok], ".2f")
    secs = " / ".join(f"{u['total']:.1f} ({u['generation']:.1f} / {u['scoring']:.1f} / {u['training']:.1f})"
                      for u in map(last_update, ok) if u) or "-"
    lengths = sorted({round(u["mean_length"], 1) for r in ok for u in r["updates"] if u.get("mean_length") is not None})
    if failed:
        rss = f"{rss}; FAILED x{len(failed)}: {failed[0]}" if ok else f"FAILED: {failed[0]}"
    return rss, secs, ", ".join(map(str, lengths)) or "-"


def ratio(a, b) -> str:
    return f"{a / b:.2f}" if a is not None and b else "-"


def results_table(results: list[dict]) -> str:
    names = list(dict.fromkeys(r["row"] for r in results))
    head = ["row", "tokens", "rlhflab peak RSS GB", "rlhflab s/update (gen / score / train)", "TRL peak RSS GB",
            "TRL s/update (gen / score / train)", "RSS x TRL", "time x TRL", "answer lengths rlhflab | TRL"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    medians = {}
    for name in names:
        runs = [r for r in results if r["row"] == name]
        ours = [r for r in runs if r["library"] == "rlhflab"]
        theirs = [r for r in runs if r["library"] == "trl"]
        m = lambda rs, f: median([f(r) for r in rs if "failed" not in r])  # noqa: E731
        rss = (m(ours, lambda r: r["peak_rss_mib"]), m(theirs, lambda r: r["peak_rss_mib"]))
        sec = (m(ours, lambda r: last_update(r)["total"]), m(theirs, lambda r: last_update(r)["total"]))
        medians[name] = {"rss": rss, "sec": sec}
        o, t = side_cells(ours), side_cells(theirs)
        lines.append(f"| {name} | {runs[0]['new_tokens']} | {o[0]} | {o[1]} | {t[0]} | {t[1]} | "
                     f"{ratio(*rss)} | {ratio(*sec)} | {o[2]} \\| {t[2]} |")
    notes = ["", "Every run listed (a / b / c = repeats); RSS x TRL and time x TRL are ratios of medians (rlhflab / "
             "TRL; < 1 = rlhflab smaller / faster). s/update = the last of the run's updates (the peak RSS is over "
             "all of them). The phases are not cut at the same places: rlhflab's scoring holds the policy forward "
             "whose graph its training reuses (so its training is backward + step), TRL GRPO's training holds the "
             "policy forward; compare totals, and generation with generation."]
    how = sorted({f"{r['row'].split('-')[0]}: " + (r.get("bf16_by") or f"Accelerator mixed_precision="
                                                     f"{r.get('mixed_precision')}")
                  for r in results if r["library"] == "trl" and "-bf16" in r["row"] and "failed" not in r})
    if how:
        notes.append("- TRL's bf16 rows: " + "; ".join(how) + " (rlhflab: --mixed_precision bf16)")
    # derived figures the issue's "Done when" reads
    for precision in ("fp32", "bf16"):
        for kind in ("full", "lora"):
            a, b = medians.get(f"grpo-{kind}-{precision}"), medians.get(f"grpo-{kind}-{precision}-gc")
            if a and b and a["rss"][0] and b["rss"][0]:
                notes.append(f"- gradient checkpointing, rlhflab GRPO {kind} {precision}: peak RSS "
                             f"{a['rss'][0] / 1024:.2f} -> {b['rss'][0] / 1024:.2f} GB "
                             f"({100 * (1 - b['rss'][0] / a['rss'][0]):.0f} % less)")
        base, longer = f"grpo-lora-{precision}-gc", None
        longer = next((n for n in medians if n.startswith(base + "-t")), None)
        if base in medians and longer:
            n0 = next(r["new_tokens"] for r in results if r["row"] == base)
            n1 = next(r["new_tokens"] for r in results if r["row"] == longer)
            growth = [(medians[longer]["rss"][i] - medians[base]["rss"][i]) / (n1 - n0)
                      if medians[longer]["rss"][i] and medians[base]["rss"][i] else None for i in (0, 1)]
            notes.append(f"- memory growth per generated token ({n0} -> {n1}), LoRA + checkpointing {precision}: "
                         f"rlhflab {fmt_runs([growth[0]], '.2f')} MiB, TRL {fmt_runs([growth[1]], '.2f')} MiB "
                         f"(ratio {ratio(*growth)})")
    return "\n".join(lines + notes)


def write_results(out: Path, header: list[str], results: list[dict]) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text("\n".join(f"- {h}" for h in header) + "\n\n" + results_table(results) + "\n")


def summary_line(r: dict) -> str:
    if "failed" in r:
        return f"FAILED: {r['failed']}"
    u = last_update(r)
    lengths = sorted({round(x["mean_length"], 1) for x in r["updates"] if x.get("mean_length") is not None})
    return (f"peak RSS {r['peak_rss_mib'] / 1024:.2f} GB, last update {u['total']:.1f} s (generation "
            f"{u['generation']:.1f}, scoring {u['scoring']:.1f}, training {u['training']:.1f}), lengths {lengths}, "
            f"process wall {r['wall_seconds']:.0f} s")
