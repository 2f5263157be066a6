"""Writes of the service, one module per entity, functions named ``<entity>_<action>``."""
