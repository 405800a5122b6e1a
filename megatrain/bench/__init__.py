"""Running benchmark cases and suites: arguments, one case, records, FLOPs, traces, the machine probe, the memory
pre-flight."""
