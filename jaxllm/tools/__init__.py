"""Diagnostics off the generate path: profiler traces, GPU telemetry, the roofline, model presets."""
