"""Training learned drafters for a target: data, the frozen target pass, the head modules and the loop."""
