"""Dashboards and alert rules as code; see ``generate``."""
