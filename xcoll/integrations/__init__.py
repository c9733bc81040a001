"""Integrations with other libraries; each module imports its library when
imported itself, and nothing here is imported by ``import xcoll``."""
