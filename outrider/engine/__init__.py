"""The engine: the one loop every front end runs (requests, scheduling, rounds, stopping, text)."""
