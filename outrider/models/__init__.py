"""The model runtime: our own decoder, its loader, and the packaged models."""
