"""The planner: sizes the prefill and decode pools from measured load and the SLO (docs/planner.md)."""
