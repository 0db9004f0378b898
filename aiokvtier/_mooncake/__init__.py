"""The remote tier: blocks in a Mooncake Store cluster."""
