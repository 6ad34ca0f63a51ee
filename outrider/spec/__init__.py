"""Speculative decoding: draft trees, exact verifiers and the round."""
