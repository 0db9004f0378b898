"""Adapters that let serving engines load aiokvtier by configuration."""
