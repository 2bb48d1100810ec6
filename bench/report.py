"""What every benchmark does with its result: print the markdown and keep it under bench/results/."""

from __future__ import annotations

from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def publish(lines: list[str], name: str) -> Path:
    """Print the table's lines and write them to bench/results/<name>; returns that path."""
    text = "\n".join(lines) + "\n"
    print(text)
    path = RESULTS_DIR / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def wait_rows(rows: list[tuple[int, float, dict[str, float]]], now: str) -> list[str]:
    """Table rows of a step measured alone, with some work before it ("before") and with the work beside it
    (`now`), in ms: prompt tokens, MiB, the three times, now/before, and what the step waited in each."""
    out = []
    for tokens, mib, m in rows:
        out.append(
            f"| {tokens:,} | {mib:.0f} | {m['alone']:.1f} | {m['before']:.1f} | {m[now]:.1f} | "
            f"x{m[now] / m['before']:.2f} | {m['before'] - m['alone']:.1f} / {m[now] - m['alone']:.1f} |"
        )
    return out
