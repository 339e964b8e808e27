"""Timelines: a schematic of eager against graphed kernel launches (notebook 06)."""

from __future__ import annotations


def plot_launch_timeline(n_kernels: int = 10, launch_us: float = 5.0, kernel_us: float = 2.0,
                         graph_launch_us: float = 8.0, axes=None):
    """A schematic (not a measurement) of one step's host launches and device kernels,
    eager and graphed: when each kernel takes less time than a launch, the device idles
    between kernels in eager mode; a graph launches them all at once."""
    import matplotlib.pyplot as plt

    if axes is None:
        _, axes = plt.subplots(2, 1, figsize=(9, 3.4), sharex=True)
    eager_end = n_kernels * launch_us + kernel_us
    graph_end = graph_launch_us + n_kernels * kernel_us
    for ax, title in zip(axes, ("eager: the host launches every kernel",
                                "graphed: one launch replays them all"), strict=True):
        ax.set_yticks([0.5, 1.5], ["device", "host"])
        ax.set_ylim(0, 2)
        ax.set_title(title, fontsize=10, loc="left")
    host, device, free = [], [], 0.0
    for i in range(n_kernels):
        host.append((i * launch_us, launch_us * 0.9))
        start = max((i + 1) * launch_us, free)
        device.append((start, kernel_us * 0.95))
        free = start + kernel_us
    axes[0].broken_barh(host, (1.1, 0.8), color="tab:orange")
    axes[0].broken_barh(device, (0.1, 0.8), color="tab:blue")
    axes[1].broken_barh([(0, graph_launch_us * 0.95)], (1.1, 0.8), color="tab:orange")
    axes[1].broken_barh([(graph_launch_us + i * kernel_us, kernel_us * 0.95)
                         for i in range(n_kernels)], (0.1, 0.8), color="tab:blue")
    axes[1].set_xlabel(f"time (µs), schematic: launch {launch_us:g} µs, kernel {kernel_us:g} µs "
                       f"→ eager {eager_end:g} µs, graphed {graph_end:g} µs")
    axes[1].set_xlim(0, max(eager_end, graph_end) * 1.02)
    return axes
