"""The deterministic rack-scale simulator: engine.py (events, workers, KV, failures), routing.py (the router's own
policy objects over the simulated state), profile.py (cost models as data, loadgen/profiles/*.json)."""
