"""Matplotlib figures built from analysis and tracking data; every function returns a Figure."""
