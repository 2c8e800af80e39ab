"""Private helpers the hooks share: background work, atomic files, the GC pause, argument checks, NaN checks,
warnings."""
