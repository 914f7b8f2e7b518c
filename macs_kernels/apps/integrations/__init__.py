"""Adapters that make MACS a method of other attribution libraries (imported only when asked for)."""
