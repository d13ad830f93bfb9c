"""gpufleet: a GPU job platform (queue, fair share, best-fit placement, node agents)."""

__version__ = "0.1.0"
