"""Tidal: one GPU pool for interactive chat and batch LLM work.

The core package holds what every part shares: settings, the fleet config, the clock and
common types. Subsystems live in the sibling top-level packages (``api``, ``router``,
``priority``, ``scheduler``, ``workers``, ``batch_jobs``, ``replicas``, ``bench``).
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
