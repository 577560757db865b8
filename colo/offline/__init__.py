"""Offline tools over recorded traces: replay, tune, export, the phase summary."""
