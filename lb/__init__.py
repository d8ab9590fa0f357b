"""The balancer: configuration, the request pipeline, backends and their health, operations."""

__version__ = "0.3.0"
