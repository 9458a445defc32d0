"""Simulation side of roundpipe: hardware and model presets (``sim.presets``), later the event simulator.

Pure Python: nothing here imports torch, so planning and simulation run anywhere.
"""
