"""Moving snapshots between nodes (contract only for now; see transfer/api.py)."""
