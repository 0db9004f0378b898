"""Host memory: syscalls, the unit layout, slots, the fill, backings, views and the tier."""
