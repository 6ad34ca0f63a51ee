"""Speculation-length controllers and the measured verify-cost profile."""
