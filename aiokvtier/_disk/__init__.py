"""The disk tier: blocks in one data file of fixed-size slots, found again after a restart through a journal."""
