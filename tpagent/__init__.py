"""tpagent: model-transparent checkpoint/restore of GPU training processes."""

__version__ = "0.1.0"
