"""The model catalog: registry-packaged models and imported GGUFs; pull, verify, repair, locks."""
