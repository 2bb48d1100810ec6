"""Request timelines as a waterfall picture: one self-contained HTML page with an inline SVG.

Input: timeline records as the frontend serves them (`GET /v1/requests/{id}/timeline`) and writes them to the
request log — `phases` with start/end seconds from the request's start, `start_unix_s`, workers, route reason,
transfer. One row per request, one coloured bar per phase on a shared time axis (so the last N requests show
how they overlapped), the numbers a person asks for first beside each row and in each bar's tooltip.

This room only draws; it never fetches (services/cli.py does) and never imports a service.
"""

from __future__ import annotations

import html
import json
from collections.abc import Iterable, Sequence
from typing import Any

PHASE_COLOURS = {
    "queued": "#9e9e9e",
    "routed": "#ffb300",
    "prefilling": "#1e88e5",
    "transferring": "#8e24aa",
    "decoding": "#43a047",
    "migrating": "#e53935",
}
ROW_H = 26
LABEL_W = 430
BAR_W = 760
AXIS_H = 30


def read_request_log(lines: Iterable[str]) -> list[dict[str, Any]]:
    """The timeline records in a request log (other lines, e.g. a logger's prefix, are skipped)."""
    records = []
    for line in lines:
        start = line.find("{")
        if start < 0:
            continue
        try:
            record = json.loads(line[start:])
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "phases" in record and "request_id" in record:
            records.append(record)
    return records


def render_html(records: Sequence[dict[str, Any]], title: str = "rackserve request timelines") -> str:
    if not records:
        raise ValueError("no request timelines to draw")
    t0 = min(r["start_unix_s"] for r in records)
    t1 = max(r["start_unix_s"] + max((p["end_s"] for p in r["phases"]), default=0.0) for r in records)
    span_s = max(t1 - t0, 1e-6)
    scale = BAR_W / span_s
    height = AXIS_H + ROW_H * len(records) + 10
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{LABEL_W + BAR_W + 20}" height="{height}" '
        'font-family="sans-serif" font-size="11">'
    ]
    for k in range(6):  # the time axis
        x = LABEL_W + BAR_W * k / 5
        parts.append(f'<line x1="{x:.1f}" y1="{AXIS_H - 6}" x2="{x:.1f}" y2="{height}" stroke="#ddd"/>')
        parts.append(f'<text x="{x:.1f}" y="{AXIS_H - 10}" text-anchor="middle">{span_s * k / 5:.3f}s</text>')
    for i, r in enumerate(records):
        y = AXIS_H + i * ROW_H
        offset = r["start_unix_s"] - t0
        parts.append(f'<text x="4" y="{y + 16}">{html.escape(_label(r))}</text>')
        for p in r["phases"]:
            x = LABEL_W + (offset + p["start_s"]) * scale
            w = max(p["duration_s"] * scale, 1.0)
            colour = PHASE_COLOURS.get(p["phase"], "#607d8b")
            tip = html.escape(
                f"{p['phase']}: {p['duration_s'] * 1000:.1f} ms (from +{p['start_s'] * 1000:.1f} ms)"
            )
            parts.append(
                f'<rect class="phase {p["phase"]}" x="{x:.2f}" y="{y + 4}" width="{w:.2f}" height="{ROW_H - 8}" '
                f'fill="{colour}"><title>{tip}</title></rect>'
            )
    parts.append("</svg>")
    legend = " ".join(
        f'<span style="background:{c};color:white;padding:1px 6px;margin-right:4px">{html.escape(p)}</span>'
        for p, c in PHASE_COLOURS.items()
    )
    rows = "\n".join(_detail_row(r) for r in records)
    return (
        "<!doctype html>\n<html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title>"
        "<style>body{font-family:sans-serif;margin:16px}table{border-collapse:collapse;font-size:12px}"
        "td,th{border:1px solid #ccc;padding:2px 6px;text-align:left}</style></head><body>"
        f"<h2>{html.escape(title)}</h2><p>{legend}</p>\n{''.join(parts)}\n"
        "<h3>Details</h3><table><tr><th>request</th><th>status</th><th>ttft</th><th>total</th><th>tokens</th>"
        f"<th>workers</th><th>route</th><th>transfer</th><th>trace</th></tr>\n{rows}</table></body></html>\n"
    )


def _label(r: dict[str, Any]) -> str:
    ttft = r.get("ttft_s")
    ttft_text = f"ttft {ttft * 1000:.0f}ms" if isinstance(ttft, (int, float)) else "no token"
    return f"{r['request_id'][:12]} {r.get('status', '')} {ttft_text} total {r.get('duration_s', 0) * 1000:.0f}ms"


def _detail_row(r: dict[str, Any]) -> str:
    transfer = r.get("transfer") or {}
    transfer_text = (
        f"{transfer.get('bytes', 0)} B over {transfer.get('backend')} in {transfer.get('s', 0) * 1000:.2f} ms"
        + (f" ({transfer['gb_per_s']:.3f} GB/s)" if transfer.get("gb_per_s") else "")
        if transfer
        else "-"
    )
    workers = r.get("workers") or {}
    cells = [
        r["request_id"],
        f"{r.get('status', '')} {r.get('phase', '')} {r.get('finish_reason') or r.get('error') or ''}",
        f"{r['ttft_s'] * 1000:.1f} ms" if isinstance(r.get("ttft_s"), (int, float)) else "-",
        f"{r.get('duration_s', 0) * 1000:.1f} ms",
        f"{r.get('prompt_tokens', 0)} in ({r.get('cached_tokens', 0)} cached), {r.get('completion_tokens', 0)} out",
        f"prefill {workers.get('prefill') or '-'}, decode {workers.get('decode') or '-'}",
        (r.get("route") or {}).get("reason") or "-",
        transfer_text,
        r.get("trace_id") or "-",
    ]
    return "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>"
