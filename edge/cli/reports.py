"""The start and reload reports (edge.timing writes them) as `edge status` and `edge warmup` print
them: one row per phase, the models' context settings and prefix states, each warm-up plan with
its candidates; a reload's outcome, mode and both processes' phases after a handover."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from edge.timing import Phases

__all__ = ["format_reload_report", "format_report"]


def format_report(report: dict[str, Any]) -> str:
    """The report as a table: one row per phase, then one per warm-up step."""
    lines = [f"last start: {report['started_at']}  pid {report['pid']}  host {report['host']}  "
             f"edge {report['edge_version']}",
             (f"rehearsal (nothing served): ready after {report['ready_s']:.3f} s"
              if report.get("rehearsal") else
              f"ready after {report['ready_s']:.3f} s on {', '.join(report.get('sockets', []))}"),
             *_compiled_lines(report), "",
             f"{'phase':<19}{'start s':>9}{'seconds':>9}{'MB':>9}{'MB/s':>9}  detail"]
    for p in report["phases"]:
        mb = f"{p['bytes'] / 1e6:.1f}" if "bytes" in p else ""
        rate = f"{p['mb_per_s']:.0f}" if "mb_per_s" in p else ""
        detail = ", ".join(f"{k}={v}" for k, v in p["detail"].items() if not isinstance(v, (list, dict)))
        lines.append(f"{p['name']:<19}{p['start_s']:>9.3f}{p['seconds']:>9.3f}{mb:>9}{rate:>9}  {detail}")
    lines += _model_lines(report)
    if report.get("warmup"):
        lines += ["", f"{'warm-up step':<19}{'seconds':>9}  what ran"]
        for w in report["warmup"]:
            lines.append(f"{w['name']:<19}{w['seconds']:>9.3f}  {w.get('model')}: {_warm_detail(w)}")
    for plan in report.get("calibration") or []:
        lines += _plan_lines(plan)
    return "\n".join(lines)


def _compiled_lines(report: dict[str, Any]) -> list[str]:
    """The source files this start compiled: none where the install left valid bytecode."""
    compiled = report.get("compiled") or []
    if not compiled:
        return []
    return [f"compiled {len(compiled)} source files at this start (no valid bytecode; `edge doctor` names "
            f"the fix): {', '.join(Path(c).name for c in compiled[:3])}{', ...' if len(compiled) > 3 else ''}"]


def _model_lines(report: dict[str, Any]) -> list[str]:
    """Each model's llama.cpp context settings, then each prefix state restored or computed."""
    lines = []
    for m in report.get("models") or []:
        c = m.get("context")
        if c:
            why = f" ({c['n_ctx_why']})" if c.get("n_ctx_why") else ""
            slots = f", {c['parallel']} slots ({c.get('parallel_why', 'parallel')})" if c.get("parallel") else ""
            lines.append(f"model {m['name']}: n_ctx {m.get('n_ctx')}{why}{slots}, n_batch {c['n_batch']}, n_ubatch "
                         f"{c['n_ubatch']}, threads {c['n_threads']} (batch {c['n_threads_batch']}), flash_attn "
                         f"{c['flash_attn']}, swa_full {str(c.get('swa_full')).lower()}, prompt cache up to "
                         f"{c['prompt_cache_limit_bytes'] / 2**20:.1f} MiB"
                         + ("" if c.get("use_extra_bufts", True) else ", extra buffer types off")
                         + f", KV cache {c.get('type_k', 'f16')}/{c.get('type_v', 'f16')}"
                         + _speculative(c.get("speculative")))
            e = c.get("embeddings")
            if e:  # issue 55: the embeddings context on the same weights
                lines.append(f"model {m['name']} embeddings: {e['pooling']} pooling ({e['pooling_from']}), "
                             f"n_batch {e['n_batch']}, {e['dimensions']} dimensions"
                             + (", normalized" if e["normalize"] else ""))
            for a in c.get("adapters") or []:  # issue 55: LoRA adapters on the same weights
                lines.append(f"model {m['name']} adapter {a['name']}: {a['path']}, {a['bytes'] / 2**20:.1f} MiB, "
                             f"alpha {a['alpha']}, default scale {a['scale']}")
        need = m.get("memory_mib")
        if need:
            lines.append(f"model {m['name']}: memory ~{need['dram']:.0f} MiB (weights {need['model']:.1f}, KV cache "
                         f"{need['kv_cache']:.1f}, compute buffers {need['compute']:.1f}, prompt cache up to "
                         f"{need['prompt_cache']:.1f} MiB"
                         + (f", embeddings context {need['embeddings']:.1f} MiB" if need.get("embeddings") else "")
                         + (f", adapters {need['adapters']:.1f} MiB" if need.get("adapters") else "")
                         + ")")
    rows = [(p["detail"].get("model"), r) for p in report["phases"] if p["name"] == Phases.PREFIX_STATES
            for r in p["detail"].get("prefixes", [])]
    if rows:
        lines += ["", f"{'prefix state':<19}{'tokens':>9}{'MB':>9}{'seconds':>9}  outcome (why)"]
        lines += [f"{str(r['prefix']):<19}{r['tokens']:>9}{r['bytes'] / 1e6:>9.1f}{r['seconds']:>9.3f}  "
                  f"{model}: {r['kind']} {r['outcome']}" + (f" ({r['why']})" if r.get("why") else "")
                  for model, r in rows]
    return [""] + lines if lines else []


def _speculative(s: dict[str, Any] | None) -> str:
    """A model's speculative decoding, as its context line ends (reports before issue 54: nothing)."""
    if not s:
        return ""
    if s.get("mode") == "off":
        return ", speculative off"
    return (f", speculative {s.get('mode')} ({s.get('ngram_min')}-{s.get('ngram_max')}-grams, up to "
            f"{s.get('max_draft')} tokens, steps of up to {s.get('max_step_rows')} rows)")


def _plan_lines(plan: dict[str, Any]) -> list[str]:
    """One warm-up plan: where it came from, then every candidate with first, repeat, kept."""
    name = plan.get("model") or plan.get("engine")
    head = {"calibrated": f"calibrated at this start ({plan.get('why')})",
            "stored": f"stored plan, calibrated {plan.get('calibrated_at')}",
            }.get(plan.get("plan", ""), f"{plan.get('plan')} ({plan.get('why')})")
    lines = ["", f"warm-up plan of {name}: {head}; file {plan.get('plan_file')}"]
    if plan.get("warning"):
        lines.append(f"  warning: {plan['warning']}")
    if plan.get("candidates"):  # waited: for a CPU (schedstat run_delay), over the first run and the repeat
        lines.append(f"{'candidate':<19}{'first s':>9}{'repeat s':>9}{'waited s':>15}  {'kept':<7} why")
    for c in plan.get("candidates", []):
        first, repeat = (f"{c[k]:.3f}" if c.get(k) is not None else "-" for k in ("first_s", "repeat_s"))
        waited = "/".join(f"{c[k]:.3f}" if c.get(k) is not None else "-" for k in ("delay_first_s", "delay_repeat_s"))
        kept = "pending" if c.get("pending") else "yes" if c.get("kept") else "no"
        lines.append(f"{c['name']:<19}{first:>9}{repeat:>9}{waited:>15}  {kept:<7} {c.get('why', '')}")
    lines += [f"not run: {x['name']}: {x['why']}" for x in plan.get("left_out", [])]
    return lines


def format_reload_report(report: dict[str, Any]) -> str:
    """A reload report: outcome, mode, what was kept and loaded, switch and drain, then phases."""
    head = f"last reload: {report['started_at']}  pid {report['pid']}  config {report.get('config')}"
    if report.get("reload_kind") == "process":
        return _format_handover(head, report)
    if report.get("error"):
        outcome = f"FAILED after {report['ready_s']:.3f} s: {report['error']} (the old set kept serving)"
    else:
        outcome = f"switched at {report.get('switch_s', 0):.3f} s; old set drained {_drained(report)}"
    mem = report.get("memory") or {}  # null: the reload failed before the memory guard decided
    mode = f"mode {report['mode']}: {mem.get('reason', '')}" if report.get("mode") else "mode: not decided"
    lines = [head, outcome, mode,
             f"kept: {', '.join(report.get('kept', [])) or '-'}   "
             f"loaded: {', '.join(report.get('loaded', [])) or '-'}   "
             f"freed: {', '.join(report.get('freed', [])) or '-'}", "",
             *_phase_rows(report["phases"])]
    return "\n".join(lines)


def _format_handover(head: str, report: dict[str, Any]) -> str:
    """A reload by a new process: why, the memory decision, both processes' phases."""
    new = report.get("successor") or {}
    if report.get("error"):
        outcome = f"HANDOVER FAILED after {report['ready_s']:.3f} s: {report['error']}"
    else:
        outcome = (f"handed over to pid {new.get('pid')} (edge {new.get('edge_version', '?')}) at "
                   f"{report.get('switch_s', 0):.3f} s; old process drained {_drained(report)}")
        if report.get("passed_on") or report.get("ended_at_limit"):
            outcome += (f"; {report.get('passed_on') or 0} requests passed on to the new process, "
                        f"{report.get('ended_at_limit') or 0} still running at the drain's limit")
    lines = [head.replace("last reload", "last reload (new process)"), outcome,
             f"why: {'; '.join(report.get('why') or [])}",
             f"mode {report.get('mode')}: {(report.get('memory') or {}).get('reason', '')}", "",
             *_phase_rows(report["phases"])]
    if new.get("phases"):
        lines += ["", f"new process (pid {new.get('pid')}), offsets from its exec; ready at {new.get('ready_s')} s"]
        lines += [f"{p['name']:<19}{p['start_s']:>9.3f}{p['seconds']:>9.3f}" for p in new["phases"]]
    return "\n".join(lines)


def _phase_rows(phases: list[dict[str, Any]]) -> list[str]:
    """A reload report's phase table: its header, then a row per phase with its plain details."""
    rows = [f"{'phase':<19}{'start s':>9}{'seconds':>9}  detail"]
    for p in phases:
        detail = ", ".join(f"{k}={v}" for k, v in p["detail"].items() if not isinstance(v, (list, dict)))
        rows.append(f"{p['name']:<19}{p['start_s']:>9.3f}{p['seconds']:>9.3f}  {detail}")
    return rows


def _drained(report: dict[str, Any]) -> str:
    drain = report.get("drain_s")
    return f"in {drain:.3f} s" if drain is not None else "(still draining)"


def _warm_detail(w: dict[str, Any]) -> str:
    if "output_shapes" in w:
        return f"outputs {w['output_shapes']}"
    if "events" in w:
        return f"{w['events']} streamed events"
    return f"{w.get('prompt_tokens')} prompt tokens, {w.get('completion_tokens')} generated"
