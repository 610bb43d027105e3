"""The machine: devices, dtypes, this host's measured figures, the memory meter."""
