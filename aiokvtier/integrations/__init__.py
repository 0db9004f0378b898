"""Adapters that let serving engines load aiokvtier by configuration (each imports its engine)."""
