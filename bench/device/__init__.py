"""Scripts for a lent GPU machine: checks of the simulator against real vLLM (``calibrate_h200``)."""
