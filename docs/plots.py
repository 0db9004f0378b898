"""Draw the documentation's benchmark figures from the committed results in docs/results/.

    python docs/plots.py                       # SVG into docs/figures/
    python docs/plots.py --out /tmp/f --format png

Each figure reads one results file; where the file (or the part of it a
figure needs) is missing, the figure is skipped and the summary printed at
the end says so. Needs matplotlib (the ``docs`` extra). The SVGs are
deterministic (no date, fixed ids), so drawing them again changes nothing
unless the results did.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

HERE = Path(__file__).resolve().parent
GiB = 1 << 30
ARMS = {"vmm": "tab:blue", "register": "tab:orange", "host": "tab:green", "baseline": "tab:gray"}
# The site shows a figure across its text column, about 700 px; drawn 8 in wide, its 10-12 pt text
# stays at least 10 px high there, and a PNG at DPI is 1200 px wide.
WIDTH = 8.0
DPI = 150
STYLE = {
    "svg.hashsalt": "aiokvtier",
    "svg.fonttype": "none",
    "font.size": 11,
    "axes.titlesize": 12,
    "figure.titlesize": 12,
    "axes.labelsize": 11,
    "legend.fontsize": 10,
    "xtick.labelsize": 10,
    "ytick.labelsize": 10,
}


class Missing(Exception):
    """The results a figure needs are not there."""


def _load(results: Path, name: str) -> dict[str, Any]:
    path = results / name
    if not path.exists():
        raise Missing(f"{name} is missing")
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def _need(data: dict[str, Any], *keys: str) -> Any:
    node: Any = data
    for key in keys:
        if not isinstance(node, dict) or key not in node:
            raise Missing(f"no {'.'.join(keys)}")
        node = node[key]
    return node


def _machine(data: dict[str, Any]) -> str:
    m = data.get("machine", {})
    return f"{m.get('cpus', '?')} CPUs, {m.get('memory_gib', '?')} GiB, kernel {m.get('kernel', '?')}"


def _steps(ax: Any, series: dict[str, Any], end: float, color: str, label: str) -> None:
    """A recorded fill: GiB resident at each sampled change, held flat to ``end``."""
    t, gib = series["t_s"], series["resident_gib"]
    ax.step([*t, end], [*gib, gib[-1]], where="post", color=color, label=label)
    ax.plot([series["first_allocation_ms"] / 1e3], [0], "o", color=color, ms=4)


def _progress_panel(ax: Any, title: str, quota: float, end: float, note: str) -> None:
    """Axes, legend and a note of one usable-GiB-against-time panel."""
    ax.set(
        xlabel="seconds since the allocation began",
        ylabel="GiB usable",
        title=title,
        xlim=(0, end),
        ylim=(-quota * 0.03, quota * 1.4),
    )
    _legend_below(ax)
    ax.text(0.01, 0.97, note, transform=ax.transAxes, va="top", fontsize=10, color="0.3")


def _legend_below(ax: Any, ncol: int = 2) -> None:
    """The legend under the axes, outside the data (the layout makes room for it)."""
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=ncol, frameon=False)


def _all_at_once(ax: Any, seconds: float, quota: float, end: float, style: str, label: str) -> None:
    ax.plot([0, seconds, seconds, end], [0, 0, quota, quota], style, color=ARMS["baseline"], label=label)


def fill_vs_upfront(results: Path) -> Figure:
    """When memory becomes usable: a progressive tier against allocating and pinning it all first."""
    cuda = _load(results, "cuda-h200.json")
    first = _need(cuda, "time_to_first_allocation")
    fill = _need(cuda, "fill_throughput")
    quota = float(first["quota_gib"])
    try:
        host = _need(_load(results, "fill-progress-devvm.json"), "fill_progress")
    except Missing:
        host = None
    panels = 3 if host is not None else 2
    fig, axes = plt.subplots(panels, 1, figsize=(WIDTH, 4.3 * panels), layout="constrained")
    top, bottom = axes[0], axes[-1]

    # Top: usable GiB over time on the GPU machine, recorded where the results have the series.
    recorded = cuda.get("fill_progress")
    if recorded is not None:
        quota = float(recorded["quota_gib"])
        up = [recorded["cuMemHostAlloc_s"], recorded.get("torch_pinned_empty_s") or 0.0]
        end = max(*up, *(recorded[f"aiokvtier_{b}"]["full_s"] for b in ("vmm", "register"))) * 1.08
        for backing in ("vmm", "register"):
            _steps(top, recorded[f"aiokvtier_{backing}"], end, ARMS[backing], f"aiokvtier {backing}")
        _all_at_once(top, recorded["cuMemHostAlloc_s"], quota, end, "-", "cuMemHostAlloc, all at once")
        if recorded.get("torch_pinned_empty_s"):
            _all_at_once(top, recorded["torch_pinned_empty_s"], quota, end, "--", "torch pinned empty, all at once")
        note = "recorded: resident bytes sampled every 2 ms during the fill"
        firsts = {b: recorded[f"aiokvtier_{b}"]["first_allocation_ms"] for b in ("vmm", "register")}
    else:
        # Drawn from the measured first-allocation times and fill rates.
        end = max(first["cuMemHostAlloc_ms"], first["torch_pinned_empty_ms"]) / 1e3 * 1.08
        for backing in ("vmm", "register"):
            t0 = first[f"aiokvtier_{backing}_ms"] / 1e3
            rate = fill[f"{backing}_threads1"]["gib_s"]
            t_full = t0 + quota / rate
            top.plot([0, t0, t_full, end], [0, 0, quota, quota], color=ARMS[backing], label=f"aiokvtier {backing}")
            top.plot([t0], [0], "o", color=ARMS[backing], ms=4)
        for key, label, style in (
            ("cuMemHostAlloc_ms", "cuMemHostAlloc, all at once", "-"),
            ("torch_pinned_empty_ms", "torch pinned empty, all at once", "--"),
        ):
            _all_at_once(top, first[key] / 1e3, quota, end, style, label)
        note = "drawn from the measured first-allocation times and\n1-thread fill rates, not a recorded time series"
        firsts = {b: first[f"aiokvtier_{b}_ms"] for b in ("vmm", "register")}
    _progress_panel(
        top,
        f"{quota:.0f} GiB of pinned host memory (H200)",
        quota,
        end,
        f"first allocation after {firsts['vmm']:.1f} ms (vmm), {firsts['register']:.1f} ms (register)\n{note}",
    )

    # Middle: the same recorded on the development VM, host backing against populating it all first.
    if host is not None:
        middle = axes[1]
        hq = float(host["quota_gib"])
        ours = host["aiokvtier_host"]
        hend = max(host["upfront_resident_s"], ours["full_s"]) * 1.08
        _steps(middle, ours, hend, ARMS["host"], "aiokvtier host (recorded)")
        _all_at_once(middle, host["upfront_resident_s"], hq, hend, "-", "MADV_POPULATE_WRITE, all at once")
        _progress_panel(
            middle,
            f"{hq:.0f} GiB of host memory (2-vCPU VM)",
            hq,
            hend,
            f"first allocation after {ours['first_allocation_ms']:.1f} ms; resident bytes\n"
            "sampled every 2 ms during the fill",
        )

    # Bottom: time to the first allocation against making the quota resident up front, per size.
    for name, marker in (("host-h200.json", "o"), ("host-ci-machine.json", "s")):
        try:
            rows = _need(_load(results, name), "time_to_first_allocation")
        except Missing:
            continue
        sizes = [r["quota_gib"] for r in rows]
        where = "H200" if "h200" in name else "2-vCPU VM"
        bottom.plot(sizes, [r["aiokvtier_first_allocation_ms"] for r in rows], marker, ls="-", color=ARMS["host"],
                    label=f"aiokvtier, first allocation ({where})")  # fmt: skip
        bottom.plot(sizes, [r["upfront_resident_ms"] for r in rows], marker, ls="--", color=ARMS["baseline"],
                    label=f"all resident up front ({where})")  # fmt: skip
    bottom.set(xscale="log", yscale="log", xlabel="quota, GiB", ylabel="ms until the first slot is usable",
               title="Host backing: time to the first allocation")  # fmt: skip
    bottom.set_xticks([4, 8, 16], labels=["4", "8", "16"])
    bottom.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    _legend_below(bottom)
    return fig


def probe_stalls(results: Path) -> Figure:
    """How long the process's other CUDA calls stall while a tier fills, per backing."""
    cuda = _load(results, "cuda-h200.json")
    fill = _need(cuda, "fill_throughput")
    arms: list[tuple[str, str, dict[str, Any]]] = []
    for key, label in (
        ("vmm_threads1", "vmm, 1 thread"),
        ("vmm_threads2", "vmm, 2 threads"),
        ("register_threads1", "register, 1 thread"),
        ("register_threads2", "register, 2 threads"),
        ("cuMemHostAlloc_512MiB_pieces", "cuMemHostAlloc, 512 MiB pieces"),
    ):
        if key in fill:
            color = ARMS["vmm"] if key.startswith("vmm") else ARMS["register"] if key.startswith("reg") else "0.5"
            arms.append((f"{label}\n1 process, 16 GiB", color, fill[key]))
    responsiveness = cuda.get("executor_responsiveness", {})
    for run in responsiveness.values():
        for backing in ("vmm", "register"):
            if backing in run:
                row = {
                    "worst_stall_ms": run[backing]["worst_stall_ms"],
                    "blocked_fraction": run[backing]["blocked_fraction_max"],
                    "gib_s": run[backing]["aggregate_gib_s"],
                }
                who = "1 process" if run["processes"] == 1 else f"{run['processes']} processes"
                arms.append((f"{backing}\n{who} sharing the GPU", ARMS[backing], row))
    if not arms:
        raise Missing("no fill arms with probe figures")
    fig, ax = plt.subplots(figsize=(WIDTH, 0.6 * len(arms) + 1.8), layout="constrained")
    y = range(len(arms))
    stalls = [a[2]["worst_stall_ms"] for a in arms]
    ax.barh(list(y), stalls, color=[a[1] for a in arms])
    ax.set_yticks(list(y), labels=[a[0] for a in arms])
    ax.invert_yaxis()
    ax.set_xscale("log")
    low, high = min(stalls) / 2, max(stalls) * 2
    ax.set_xlim(low, high)
    ax.set_xlabel("worst stall of a cuPointerGetAttribute probe during the fill, ms (log)")
    for i, (_, _, row) in enumerate(arms):
        # Beside a short bar, inside the end of a long one: either way within the axes.
        reach = math.log(row["worst_stall_ms"] / low) / math.log(high / low)
        inside = reach > 0.5
        ax.annotate(f"{row['gib_s']:.2f} GiB/s, probe blocked {100 * row['blocked_fraction']:.1f}%",
                    (row["worst_stall_ms"], i), xytext=(-4 if inside else 4, 0), textcoords="offset points",
                    ha="right" if inside else "left", va="center", fontsize=10,
                    color="white" if inside else "black")  # fmt: skip
    fig.suptitle(f"Probe stalls per backing while the tier fills (H200)\n{_machine(cuda)}")
    return fig


def copy_bandwidth(results: Path) -> Figure:
    """Copy bandwidth per page size, beside one large copy (the PCIe ceiling) and a per-page loop."""
    cuda = _load(results, "cuda-h200.json")
    table = _need(cuda, "copy_bandwidth")
    backing = "vmm" if "vmm" in table else next(iter(table))
    rows = table[backing]
    pages = sorted({int(k.split("_")[1].removesuffix("KiB")) for k in rows if k.startswith("slot_")})
    if not pages:
        raise Missing("no slot_* rows in copy_bandwidth")
    fig, axes = plt.subplots(1, 2, figsize=(WIDTH, 4.8), layout="constrained", sharey=True)
    for ax, direction in zip(axes, ("h2d", "d2h"), strict=True):

        def series(order: str, key: str, dirn: str = direction) -> list[float]:
            return [rows[f"slot_{p}KiB_{order}"][dirn][key] for p in pages]

        ceiling = max(series("contiguous", "one_large_copy_GBps") + series("shuffled", "one_large_copy_GBps"))
        ax.axhline(ceiling, color="0.2", lw=1, ls=":", label=f"one large copy ({ceiling:.1f} GB/s)")
        ax.plot(pages, series("shuffled", "aiokvtier_GBps"), "o-", color=ARMS[backing], label="CopyEngine, shuffled")
        ax.plot(pages, series("contiguous", "aiokvtier_GBps"), "s--", color=ARMS[backing],
                label="CopyEngine, contiguous")  # fmt: skip
        ax.plot(pages, series("shuffled", "per_slot_cuMemcpyAsync_GBps"), "^-", color=ARMS["baseline"],
                label="cuMemcpyAsync per page")  # fmt: skip
        ax.set(xscale="log", xlabel="page size, KiB", title=f"{direction.upper()} ({backing} backing)", ylim=(0, None))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xticks(pages, labels=[str(p) for p in pages])
    axes[0].set_ylabel("GB/s")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncol=2, frameon=False)
    fig.suptitle(f"Copies between tier slots and GPU memory, {rows.get('total_gib', '?')} GiB per run (H200)")
    return fig


def server_latency(results: Path) -> Figure:
    """The example server's p50 and p99 per endpoint, beside the same API over a plain dict."""
    server = _load(results, "server-ci-machine.json")
    runs = _need(server, "runs")
    names = [("blockstore", "BlockStore", ARMS["vmm"]), ("plain_dict", "plain dict", ARMS["baseline"])]
    names = [n for n in names if n[0] in runs]
    if not names:
        raise Missing("no runs")
    endpoints = list(runs[names[0][0]]["endpoints"])
    fig, ax = plt.subplots(figsize=(WIDTH, 4.8), layout="constrained")
    width = 0.8 / len(names)
    for i, (key, label, color) in enumerate(names):
        run = runs[key]
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(endpoints))]
        p50 = [run["endpoints"][e]["p50_ms"] for e in endpoints]
        p99 = [run["endpoints"][e]["p99_ms"] for e in endpoints]
        ax.bar(xs, p99, width * 0.9, color=color, alpha=0.35, label=f"{label} p99 ({run['requests_per_s']:.0f} req/s)")
        ax.bar(xs, p50, width * 0.9, color=color, label=f"{label} p50")
    ax.set_xticks(range(len(endpoints)), labels=endpoints)
    ax.set_ylabel("latency, ms")
    tallest = max(runs[key]["endpoints"][e]["p99_ms"] for key, _, _ in names for e in endpoints)
    ax.set_ylim(0, tallest * 1.08)
    run = runs[names[0][0]]
    ax.set_title(f"Example server: {run['clients']} clients, {run['block_size'] >> 10} KiB blocks\n{_machine(server)}")
    fig.legend(loc="outside lower center", ncol=2, frameon=False)
    return fig


FIGURES: dict[str, Callable[[Path], Figure]] = {
    "fill-vs-upfront": fill_vs_upfront,
    "probe-stalls": probe_stalls,
    "copy-bandwidth": copy_bandwidth,
    "server-latency": server_latency,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--results", type=Path, default=HERE / "results", help="directory of bench JSON")
    parser.add_argument("--out", type=Path, default=HERE / "figures", help="directory for the figures")
    parser.add_argument("--format", choices=["svg", "png"], default="svg", help="image format")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    plt.rcParams.update(STYLE)
    summary: dict[str, str] = {}
    for name, draw in FIGURES.items():
        try:
            fig = draw(args.results)
        except Missing as exc:
            summary[name] = f"skipped: {exc}"
            continue
        path = args.out / f"{name}.{args.format}"
        metadata = {"Date": None} if args.format == "svg" else {"Software": None}
        fig.savefig(path, metadata=metadata, dpi=DPI)
        plt.close(fig)
        summary[name] = str(path)
    json.dump(summary, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
