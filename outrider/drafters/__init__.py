"""Drafters: anything that proposes a draft tree for the target to verify."""
