"""`strata plan`: memory and node arithmetic for a model shape, context and hardware (no torch)."""
