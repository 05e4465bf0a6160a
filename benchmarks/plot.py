"""The PNG of `python -m benchmarks.compare --plot`: the seed's picture, measured.

Left: slot occupancy over time for the static and continuous runs (sequences doing useful work in
each step, over the slots). Right: cumulative generated tokens over time for every system.
"""

from __future__ import annotations

from rqbatcher.workers.bench.report import BenchReport
from rqbatcher.workers.bench.system import NO_PREFIX_CACHING_SUFFIX

FIGURE_SIZE = (12, 4.5)
DPI = 110
OCCUPANCY_SYSTEMS = ("batcher:static", "batcher:continuous", "hf-static", "hf-cb")


def plot_report(report: BenchReport, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, (occupancy, tokens) = plt.subplots(1, 2, figsize=FIGURE_SIZE)
    for s in report.systems:
        if s.system.removesuffix(NO_PREFIX_CACHING_SUFFIX) in OCCUPANCY_SYSTEMS and s.occupancy:
            times, seqs = zip(*s.occupancy)
            occupancy.step(times, [n / s.slots for n in seqs], where="pre", label=s.system)
        if s.cumulative_tokens:
            times, counts = zip(*s.cumulative_tokens)
            tokens.plot(times, counts, label=f"{s.system} ({s.generated_tok_s:.0f} tok/s)")
    occupancy.set(title="slot occupancy per step", xlabel="seconds", ylabel="sequences / slots", ylim=(0, 1.05))
    tokens.set(title="generated tokens", xlabel="seconds", ylabel="cumulative tokens")
    for ax in (occupancy, tokens):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"{report.workload}: {report.model}, {report.threads} thread(s), {report.device}", fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
