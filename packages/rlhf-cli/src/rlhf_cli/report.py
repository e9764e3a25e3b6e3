"""The run report: PNG plots of a run's metrics.jsonl and an HTML page that shows them.

python -m rlhf_cli.report RUN_DIR        # writes RUN_DIR/report/{*.png,index.html}
"""

from __future__ import annotations

import html
import sys
from pathlib import Path

from rlhf_core.rundir import read_metrics

# plot file -> (title, y label, metric keys drawn on it; the first present ones are used)
PLOTS: dict[str, tuple[str, str, list[str]]] = {
    "reward.png": ("Reward per step", "reward", ["reward/mean", "eval/pass1"]),
    "kl.png": ("KL to the reference policy", "KL", ["kl/mean", "policy/rollout_kl"]),
    "response_length.png": ("Response length", "tokens", ["response_length/mean"]),
    "throughput.png": ("Throughput", "tokens / s", ["perf/tokens_per_s", "perf/gen_tokens_per_s"]),
}


def make_report(run_dir: str | Path) -> Path:
    """Write the plots and index.html under ``run_dir/report``; returns the HTML path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir / "metrics.jsonl")
    out = run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    made = []
    for fname, (title, ylabel, keys) in PLOTS.items():
        series = {k: pts for k in keys if (pts := [(r["step"], r[k]) for r in rows if r.get(k) is not None])}
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
        for key, points in series.items():
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=key)
        ax.set(title=title, xlabel="step", ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / fname)
        plt.close(fig)
        made.append((fname, title))
    last = rows[-1] if rows else {}
    cells = {k: f"{v:.4g}" if isinstance(v, float) else html.escape(str(v)) for k, v in sorted(last.items())}
    summary = "".join(f"<tr><td>{html.escape(k)}</td><td>{v}</td></tr>" for k, v in cells.items())
    images = "".join(
        f'<figure><img src="{f}" alt="{html.escape(t)}"><figcaption>{html.escape(t)}</figcaption></figure>'
        for f, t in made
    )
    page = (
        "<!doctype html><html><head><meta charset='utf-8'><title>rlhf run report</title>"
        "<style>body{font-family:sans-serif;margin:2em}figure{display:inline-block;margin:0 1em 1em 0}"
        "td{padding:0 1em 0 0}</style></head><body>"
        f"<h1>rlhf run report</h1><p>{html.escape(str(run_dir))}: {len(rows)} steps</p>{images}"
        f"<h2>Last step</h2><table>{summary}</table></body></html>"
    )
    index = out / "index.html"
    index.write_text(page)
    return index


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m rlhf_cli.report RUN_DIR", file=sys.stderr)
        return 2
    print(make_report(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
