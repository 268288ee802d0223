"""Runnable examples of trainctl as its users drive it (each file says how to run it)."""
