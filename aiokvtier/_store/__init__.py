"""The block store: keys, eviction, pinning and copies over a tier."""
